// The sidebar's icon: three ranks joined in a ring (jp-icon3: recoloured by the theme).
import { LabIcon } from '@jupyterlab/ui-components';

const svg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M12 5.2 5.6 16.8h12.8L12 5.2zm0 3.1 4.3 7.7H7.7L12 8.3z" opacity=".55"/>
    <circle cx="12" cy="5" r="3.2"/>
    <circle cx="5" cy="17.5" r="3.2"/>
    <circle cx="19" cy="17.5" r="3.2"/>
  </g>
</svg>`;

export const hvdIcon = new LabIcon({ name: 'hvd-notebook-lab:cluster', svgstr: svg });
