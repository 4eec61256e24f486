// hvd_notebook's JupyterLab front end: a sidebar panel of the user's clusters (GET hvd-notebook/clusters,
// polled by one shared ClusterModel), a status-bar item for the notebook in focus, and a command to show
// the panel.

import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';

import { ClusterModel } from './model';
import { HvdPanel, PANEL_ID } from './panel';
import { HvdStatusItem, STATUS_ID } from './statusbar';

const PLUGIN_ID = 'hvd-notebook-lab:plugin';
const COMMAND_OPEN = 'hvd-notebook:open-panel';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: "hvd_notebook's clusters: a sidebar panel and a status-bar item.",
  autoStart: true,
  optional: [INotebookTracker, IStatusBar, ICommandPalette, ILayoutRestorer],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker | null,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null
  ): void => {
    const model = new ClusterModel();
    const panel = new HvdPanel(app, model);
    app.shell.add(panel, 'left', { rank: 600 });
    if (restorer) {
      restorer.add(panel, PANEL_ID);
    }

    const openPanel = () => {
      app.shell.activateById(PANEL_ID);
    };
    app.commands.addCommand(COMMAND_OPEN, {
      label: 'Show hvd_notebook clusters',
      caption: "hvd_notebook: this user's clusters, their ranks and the node's GPUs",
      execute: openPanel
    });
    if (palette) {
      palette.addItem({ command: COMMAND_OPEN, category: 'hvd_notebook' });
    }

    // the kernel of the notebook in focus: the status-bar item shows its cluster, and the poller is fast
    // while there is one
    if (tracker) {
      let watched: NotebookPanel | null = null;
      const updateKernel = () => {
        const kernel = tracker.currentWidget?.sessionContext.session?.kernel;
        model.focusKernel = kernel ? kernel.id : null;
      };
      const onCurrent = () => {
        if (watched) {
          watched.sessionContext.kernelChanged.disconnect(updateKernel);
          watched.sessionContext.sessionChanged.disconnect(updateKernel);
        }
        watched = tracker.currentWidget;
        if (watched) {
          watched.sessionContext.kernelChanged.connect(updateKernel);
          watched.sessionContext.sessionChanged.connect(updateKernel);
        }
        updateKernel();
      };
      tracker.currentChanged.connect(onCurrent);
      onCurrent();
    }

    if (statusBar) {
      const item = new HvdStatusItem(model, openPanel);
      statusBar.registerStatusItem(STATUS_ID, {
        item,
        align: 'left',
        rank: 50,
        isActive: () => item.isActiveItem,
        activeStateChanged: item.activeStateChanged
      });
    }

    void app.restored.then(() => model.start());
  }
};

export default plugin;
