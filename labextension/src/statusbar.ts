// The status-bar item for the notebook in focus: "hvd · 2 ranks · CPU · idle 0:42", hidden when that
// notebook's kernel owns no cluster. A click shows the panel.

import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { devicesSummary, formatDuration, plural, stateShort } from './api';
import { ClusterModel } from './model';

export const STATUS_ID = 'hvd-notebook-status';

export class HvdStatusItem extends Widget {
  constructor(
    private readonly model: ClusterModel,
    private readonly onOpen: () => void
  ) {
    super({ node: document.createElement('div') });
    this.id = STATUS_ID;
    this.addClass('hvd-statusbar-item');
    this.addClass('jp-StatusBar-TextItem');
    this.node.title = 'hvd_notebook: the cluster of this notebook (click: show the clusters panel)';
    this.node.setAttribute('role', 'button');
    this.node.tabIndex = 0;
    this.node.addEventListener('click', this._open);
    this.node.addEventListener('keydown', this._onKey);
    model.changed.connect(this._update, this);
    this._update();
  }

  /** Whether the notebook in focus has a cluster (the status bar shows the item only then). */
  get isActiveItem(): boolean {
    return this._active;
  }

  get activeStateChanged(): ISignal<this, void> {
    return this._activeStateChanged;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.model.changed.disconnect(this._update, this);
    this.node.removeEventListener('click', this._open);
    this.node.removeEventListener('keydown', this._onKey);
    Signal.clearData(this);
    super.dispose();
  }

  private _update(): void {
    const data = this.model.data;
    const cluster = this.model.clusterForKernel(this.model.focusKernel);
    let text = '';
    if (data && cluster) {
      const state = stateShort(cluster.state);
      text = [
        'hvd',
        plural(cluster.n, 'rank'),
        devicesSummary(cluster),
        `${state} ${formatDuration(data.time - cluster.since)}`
      ].join(' · ');
      this.node.dataset.clusterId = cluster.id;
      this.node.dataset.state = cluster.state;
    } else {
      delete this.node.dataset.clusterId;
      delete this.node.dataset.state;
    }
    if (this.node.textContent !== text) {
      this.node.textContent = text;
    }
    const active = cluster !== null;
    this.node.hidden = !active;
    if (active !== this._active) {
      this._active = active;
      this._activeStateChanged.emit();
    }
  }

  private _open = (): void => {
    this.onOpen();
  };

  private _onKey = (event: KeyboardEvent): void => {
    if (event.key === 'Enter' || event.key === ' ') {
      event.preventDefault();
      this.onOpen();
    }
  };

  private _active = false;
  private _activeStateChanged = new Signal<this, void>(this);
}
