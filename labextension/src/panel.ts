// The left-sidebar panel: this user's clusters on this node, their ranks, the node's GPUs, other users' leases.
// Plain DOM in a Lumino widget. Each cluster's block is kept (keyed by its id) and updated in place, so that
// its buttons are not replaced under the pointer every 1.5 s; blocks of clusters that are gone are removed.

import { JupyterFrontEnd } from '@jupyterlab/application';
import {
  Clipboard,
  Dialog,
  Notification,
  showDialog,
  showErrorMessage
} from '@jupyterlab/apputils';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import {
  baseName,
  ClusterAction,
  deleteSuspended,
  formatBytes,
  formatClock,
  formatDuration,
  formatPercent,
  ICluster,
  IClustersReply,
  INodeGpu,
  IRank,
  ISuspended,
  plural,
  postAction,
  shortCommand,
  stateWords
} from './api';
import { ClusterModel, HISTORY_LENGTH } from './model';
import { hvdIcon } from './icon';

export const PANEL_ID = 'hvd-notebook-panel';

const ACTION_LABELS: Record<ClusterAction, string> = {
  interrupt: 'Interrupt',
  restart: 'Restart',
  stop: 'Stop',
  stacks: 'Where is every rank?'
};

const ACTION_TITLES: Record<ClusterAction, string> = {
  interrupt: "interrupt the cell the ranks are running (like the notebook's interrupt button)",
  restart: 'start the ranks again with the same options; their variables are lost',
  stop: "stop the ranks and release their GPUs; their variables are lost",
  stacks: "show every rank's Python stack: where each one is, and what it waits for"
};

const PENDING_WORDS: Record<ClusterAction, string> = {
  interrupt: 'interrupting…',
  restart: 'restarting…',
  stop: 'stopping…',
  stacks: "collecting every rank's stack…"
};

const ACTION_ORDER: ClusterAction[] = ['interrupt', 'restart', 'stop', 'stacks'];

/** How long the line with an action's answer stays. */
const MESSAGE_MS = 10000;

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className?: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

const SVG_NS = 'http://www.w3.org/2000/svg';

/** A sparkline of up to HISTORY_LENGTH samples; null samples are gaps. */
export function sparkline(
  values: (number | null)[],
  series: 'cpu' | 'gpu',
  label: string
): SVGSVGElement {
  const width = HISTORY_LENGTH;
  const height = 16;
  const svg = document.createElementNS(SVG_NS, 'svg');
  svg.setAttribute('class', `hvd-spark hvd-spark-${series}`);
  svg.setAttribute('data-series', series);
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  svg.setAttribute('preserveAspectRatio', 'none');
  svg.setAttribute('width', `${width}`);
  svg.setAttribute('height', `${height}`);
  const numbers = values.filter((v): v is number => v !== null && isFinite(v));
  const top = Math.max(100, ...numbers);
  const title = document.createElementNS(SVG_NS, 'title');
  title.textContent = numbers.length
    ? `${label} over the last ${values.length} samples: now ${formatPercent(
        values[values.length - 1]
      )}, highest ${formatPercent(Math.max(...numbers))}`
    : `${label}: no samples yet`;
  svg.appendChild(title);
  const base = document.createElementNS(SVG_NS, 'line');
  base.setAttribute('class', 'hvd-spark-base');
  base.setAttribute('x1', '0');
  base.setAttribute('x2', `${width}`);
  base.setAttribute('y1', `${height - 0.5}`);
  base.setAttribute('y2', `${height - 0.5}`);
  svg.appendChild(base);
  // right-aligned: the newest sample at the right edge
  const offset = width - values.length;
  let run: string[] = [];
  const flush = () => {
    if (run.length === 1) {
      // a lone sample: a short dash so that it shows
      const [x, y] = run[0].split(',').map(Number);
      run = [`${Math.max(0, x - 1)},${y}`, `${x},${y}`];
    }
    if (run.length > 1) {
      const line = document.createElementNS(SVG_NS, 'polyline');
      line.setAttribute('class', 'hvd-spark-line');
      line.setAttribute('points', run.join(' '));
      svg.appendChild(line);
    }
    run = [];
  };
  values.forEach((v, i) => {
    if (v === null || !isFinite(v)) {
      flush();
      return;
    }
    const x = offset + i + 1;
    const y = 1 + (height - 2) * (1 - Math.min(v, top) / top);
    run.push(`${x},${y.toFixed(1)}`);
  });
  flush();
  return svg;
}

/** One cluster's block, kept while the cluster is listed. */
class ClusterView {
  readonly node = el('section', 'hvd-cluster');

  constructor(private readonly panel: HvdPanel) {
    this._title.appendChild(this._titleName);
    this.node.append(
      this._title,
      this._state,
      this._meta,
      this._lease,
      this._actions,
      this._pending,
      this._message,
      this._ranksWrap
    );
    this._ranksWrap.appendChild(this._ranks);
    this._pending.hidden = true;
    this._message.hidden = true;
    this._ranks.setAttribute('role', 'table');
  }

  get cluster(): ICluster | null {
    return this._cluster;
  }

  update(
    cluster: ICluster,
    reply: IClustersReply,
    pending: ClusterAction | undefined
  ): void {
    this._cluster = cluster;
    const node = this.node;
    node.dataset.clusterId = cluster.id;
    node.dataset.state = cluster.state;
    node.dataset.kind = cluster.kind;
    node.classList.toggle('hvd-cluster-busy', pending !== undefined);

    // title: the notebook (a button that opens it) or the script's command line
    this._updateTitle(cluster);

    // state and how long it has lasted (server clock)
    const elapsed = formatDuration(reply.time - cluster.since);
    let state = `${stateWords(cluster)} ${elapsed}`;
    if (cluster.detail) {
      state += ` — ${cluster.detail}`;
    }
    this._state.textContent = state;
    this._state.title = `since ${formatClock(cluster.since)} (cluster ${cluster.id})`;

    // ranks, hosts, framework, backend
    const meta = [
      `${plural(cluster.n, 'rank')} on ${cluster.hosts.length ? cluster.hosts.join(', ') : '?'}`
    ];
    if (cluster.framework) {
      meta.push(cluster.framework);
    }
    if (cluster.backend) {
      meta.push(cluster.backend);
    }
    this._meta.textContent = meta.join(' · ');

    // the node's rules: lease end, idle release
    this._lease.replaceChildren();
    if (cluster.lease_ends !== null && cluster.lease_ends !== undefined) {
      this._lease.appendChild(
        el(
          'span',
          'hvd-lease-ends',
          `lease ends in ${formatDuration(cluster.lease_ends - reply.time)}`
        )
      );
    }
    if (cluster.idle_release_at !== null && cluster.idle_release_at !== undefined) {
      if (this._lease.childElementCount) {
        this._lease.appendChild(document.createTextNode(' · '));
      }
      this._lease.appendChild(
        el(
          'span',
          'hvd-idle-release',
          `released if idle in ${formatDuration(cluster.idle_release_at - reply.time)}`
        )
      );
    }
    this._lease.hidden = this._lease.childElementCount === 0;

    this._updateActions(cluster, pending);

    this._pending.hidden = pending === undefined;
    this._pending.textContent = pending ? PENDING_WORDS[pending] : '';

    this._updateRanks(cluster, reply);
  }

  /** Shows an action's answer for a while. */
  showMessage(text: string, error = false): void {
    window.clearTimeout(this._messageTimer);
    this._message.textContent = text;
    this._message.classList.toggle('hvd-message-error', error);
    this._message.hidden = !text;
    this._messageTimer = window.setTimeout(() => {
      this._message.hidden = true;
      this._message.textContent = '';
    }, MESSAGE_MS);
  }

  dispose(): void {
    window.clearTimeout(this._messageTimer);
    this.node.remove();
  }

  private _updateTitle(cluster: ICluster): void {
    const key = `${cluster.kind}\u0000${cluster.notebook}\u0000${cluster.command}`;
    if (key === this._titleKey) {
      return;
    }
    this._titleKey = key;
    let name: HTMLElement;
    if (cluster.kind === 'script') {
      name = el('span', 'hvd-cluster-command', shortCommand(cluster.command || 'a script'));
      name.title = cluster.command || '';
    } else if (cluster.notebook) {
      const path = cluster.notebook;
      const button = el('button', 'hvd-open-notebook', baseName(path));
      button.type = 'button';
      button.title = `open ${path}`;
      button.dataset.path = path;
      button.addEventListener('click', () => {
        void this.panel.app.commands
          .execute('docmanager:open', { path })
          .catch(reason => {
            void showErrorMessage(`hvd_notebook: cannot open ${path}`, reason);
          });
      });
      name = button;
    } else {
      name = el('span', 'hvd-cluster-unknown', "a notebook's kernel");
    }
    this._title.replaceChild(name, this._titleName);
    this._titleName = name;
  }

  private _updateActions(
    cluster: ICluster,
    pending: ClusterAction | undefined
  ): void {
    const actions = ACTION_ORDER.filter(a => cluster.actions.includes(a));
    const key = actions.join(',');
    if (key !== this._actionsKey) {
      this._actionsKey = key;
      this._actions.replaceChildren();
      this._buttons = [];
      for (const action of actions) {
        const button = el(
          'button',
          `hvd-action hvd-action-${action}`,
          ACTION_LABELS[action]
        );
        button.type = 'button';
        button.title = ACTION_TITLES[action];
        button.dataset.action = action;
        button.addEventListener('click', () => {
          if (this._cluster) {
            void this.panel.runAction(this._cluster, action);
          }
        });
        this._buttons.push(button);
        this._actions.appendChild(button);
      }
    }
    this._actions.hidden = actions.length === 0;
    for (const button of this._buttons) {
      button.disabled = pending !== undefined;
    }
  }

  private _updateRanks(cluster: ICluster, reply: IClustersReply): void {
    const withGpus = reply.gpus !== null && reply.gpus !== undefined;
    const table = this._ranks;
    table.classList.toggle('hvd-with-gpus', withGpus);
    const head = el('thead');
    const headRow = el('tr');
    const headers: [string, string, string][] = [
      ['rank', '#', 'rank'],
      ['device', 'device', 'device'],
      ['cpu', 'CPU', 'CPU % of one core (can exceed 100)'],
      ['mem', 'mem', 'resident memory']
    ];
    if (withGpus) {
      headers.push(
        ['gpu-util', 'GPU', 'GPU utilization'],
        ['gpu-mem', 'GPU mem', "this rank's GPU memory (of its process)"]
      );
    }
    headers.push([
      'spark',
      '',
      withGpus
        ? 'CPU % (top) and GPU util (bottom), last samples'
        : 'CPU %, last samples'
    ]);
    for (const [key, text, title] of headers) {
      const th = el('th', `hvd-col-${key}`, text);
      th.title = title;
      headRow.appendChild(th);
    }
    head.appendChild(headRow);
    const body = el('tbody');
    for (const rank of cluster.ranks) {
      body.appendChild(this._rankRow(cluster, rank, withGpus));
    }
    table.replaceChildren(head, body);
  }

  private _rankRow(cluster: ICluster, rank: IRank, withGpus: boolean): HTMLTableRowElement {
    const row = el('tr', 'hvd-rank-row');
    row.dataset.rank = `${rank.rank}`;
    if (!rank.alive) {
      row.classList.add('hvd-rank-dead');
    }
    row.title =
      `rank ${rank.rank}` +
      (rank.pid !== null && rank.pid !== undefined ? `, pid ${rank.pid}` : '') +
      (rank.host ? ` on ${rank.host}` : '') +
      (rank.alive ? '' : ': dead (its process has ended)');
    row.appendChild(el('td', 'hvd-rank-id', `${rank.rank}`));
    row.appendChild(el('td', 'hvd-rank-device', rank.device));
    const cpu = el('td', 'hvd-rank-cpu hvd-num', formatPercent(rank.cpu_percent));
    cpu.dataset.cpu =
      rank.cpu_percent === null || rank.cpu_percent === undefined ? '' : `${rank.cpu_percent}`;
    row.appendChild(cpu);
    row.appendChild(el('td', 'hvd-rank-mem hvd-num', formatBytes(rank.rss)));
    if (withGpus) {
      const gpu = rank.gpu;
      const util = el('td', 'hvd-rank-gpu-util hvd-num', formatPercent(gpu ? gpu.util : null));
      util.dataset.gpuUtil = gpu && gpu.util !== null ? `${gpu.util}` : '';
      row.appendChild(util);
      let memText = '—';
      if (gpu) {
        memText =
          gpu.process_memory !== null && gpu.process_memory !== undefined
            ? formatBytes(gpu.process_memory)
            : `${formatBytes(gpu.memory_used)}`;
      }
      const mem = el('td', 'hvd-rank-gpu-mem hvd-num', memText);
      if (gpu) {
        mem.title = `card: ${formatBytes(gpu.memory_used)} of ${formatBytes(gpu.memory_total)} used`;
      }
      row.appendChild(mem);
    }
    const sparks = el('td', 'hvd-rank-spark');
    const history = this.panel.model.history(cluster.id, rank.rank);
    sparks.appendChild(sparkline(history.cpu, 'cpu', 'CPU %'));
    if (withGpus) {
      sparks.appendChild(sparkline(history.gpu, 'gpu', 'GPU util'));
    }
    row.appendChild(sparks);
    return row;
  }

  private _cluster: ICluster | null = null;
  private _title = el('div', 'hvd-cluster-title');
  private _titleName: HTMLElement = el('span');
  private _titleKey = '';
  private _state = el('div', 'hvd-cluster-state');
  private _meta = el('div', 'hvd-cluster-meta');
  private _lease = el('div', 'hvd-cluster-lease');
  private _actions = el('div', 'hvd-cluster-actions');
  private _actionsKey: string | null = null;
  private _buttons: HTMLButtonElement[] = [];
  private _pending = el('div', 'hvd-cluster-pending');
  private _message = el('div', 'hvd-cluster-message');
  private _messageTimer: number | undefined = undefined;
  private _ranks = el('table', 'hvd-ranks');
  private _ranksWrap = el('div', 'hvd-ranks-wrap');
}

export class HvdPanel extends Widget {
  constructor(
    readonly app: JupyterFrontEnd,
    readonly model: ClusterModel
  ) {
    super();
    this.id = PANEL_ID;
    this.addClass('hvd-panel');
    this.title.icon = hvdIcon;
    this.title.caption = 'hvd_notebook clusters';

    const header = el('div', 'hvd-panel-header');
    header.appendChild(el('h2', 'hvd-heading', 'Your clusters'));
    this._error.hidden = true;
    this._empty.hidden = true;
    this._nodeGpus.hidden = true;
    this._others.hidden = true;
    this._nodeGpus.appendChild(el('h3', 'hvd-subheading', "This node's GPUs"));
    this._nodeGpus.appendChild(this._gpuTable);
    this._caps.hidden = true;
    this._others.appendChild(el('h3', 'hvd-subheading', 'Other users'));
    this._others.appendChild(this._otherList);
    this._queue.hidden = true;
    this._queue.appendChild(el('h3', 'hvd-subheading', 'Waiting for GPUs'));
    this._queue.appendChild(this._queueList);
    this._suspended.hidden = true;
    this._suspended.appendChild(el('h3', 'hvd-subheading', 'Suspended'));
    this._suspended.appendChild(this._suspendedList);
    this.node.append(
      header,
      this._error,
      this._loading,
      this._empty,
      this._clusters,
      this._suspended,
      this._nodeGpus,
      this._caps,
      this._others,
      this._queue
    );
    model.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.model.changed.disconnect(this._render, this);
    for (const view of this._views.values()) {
      view.dispose();
    }
    this._views.clear();
    super.dispose();
  }

  /** Asks (for stop and restart), posts the action, shows its answer. */
  async runAction(cluster: ICluster, action: ClusterAction): Promise<void> {
    if (this._pending.has(cluster.id)) {
      return;
    }
    const name =
      cluster.kind === 'script'
        ? 'the script'
        : cluster.notebook
          ? baseName(cluster.notebook)
          : "the notebook's cluster";
    if (action === 'stop' || action === 'restart') {
      const ranks = plural(cluster.n, 'rank');
      const script = cluster.kind === 'script';
      const body =
        action === 'stop'
          ? script
            ? `The ${ranks} of the script end and release their GPUs: the ranks' variables are lost, and the run stops here.`
            : `The ${ranks} of ${name} stop and release their GPUs: the ranks' variables are lost ` +
              "(the notebook's kernel keeps running; %hvd restart in the notebook starts the ranks again)."
          : script
            ? `The ${ranks} of the script start again: the ranks' variables are lost.`
            : `The ${ranks} of ${name} start again with the same options: the ranks' variables are lost ` +
              "(re-run the notebook's set-up cells, or use %hvd restart --replay in the notebook instead).";
      const result = await showDialog({
        title: action === 'stop' ? `Stop ${name}'s cluster?` : `Restart ${name}'s cluster?`,
        body,
        buttons: [
          Dialog.cancelButton(),
          Dialog.okButton({
            label: action === 'stop' ? 'Stop' : 'Restart',
            displayType: 'warn'
          })
        ]
      });
      if (!result.button.accept) {
        return;
      }
    }
    this._pending.set(cluster.id, action);
    this._render();
    let text: string;
    try {
      const reply = await postAction(cluster.id, action);
      text = reply.text ?? '';
    } catch (error) {
      this._pending.delete(cluster.id);
      this._render();
      void this.model.refresh();
      await showErrorMessage(
        `hvd_notebook: ${action} failed`,
        error instanceof Error ? error.message : String(error)
      );
      return;
    }
    if (action === 'stacks') {
      this._pending.delete(cluster.id);
      this._render();
      await showStacks(name, text);
      return;
    }
    // what the action changed, before its answer is shown: "stopping…" until the block is gone
    await this.model.refresh();
    this._pending.delete(cluster.id);
    this._render();
    const view = this._views.get(cluster.id);
    if (view) {
      view.showMessage(text || `${ACTION_LABELS[action]}: done`);
    } else if (text) {
      // the cluster left the list (stopped; restarted, under a new id): a notification says what happened
      Notification.info(`${name}: ${text}`, { autoClose: 8000 });
    }
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this.model.panelVisible = true;
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this.model.panelVisible = false;
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this.model.panelVisible = this.isVisible;
  }

  protected onBeforeDetach(msg: Message): void {
    this.model.panelVisible = false;
    super.onBeforeDetach(msg);
  }

  private _render(): void {
    const model = this.model;
    const data = model.data;

    this._error.hidden = model.error === null;
    this._error.textContent =
      model.error === null
        ? ''
        : `the hvd_notebook server extension did not answer: ${model.error}`;
    this.node.classList.toggle('hvd-stale', model.error !== null && data !== null);
    this._loading.hidden = model.answered;

    if (!data) {
      this._empty.hidden = true;
      return;
    }
    this.node.dataset.user = data.user;

    // clusters, keyed by id, in the server's order
    const seen = new Set<string>();
    let index = 0;
    for (const cluster of data.clusters) {
      seen.add(cluster.id);
      let view = this._views.get(cluster.id);
      if (!view) {
        view = new ClusterView(this);
        this._views.set(cluster.id, view);
      }
      view.update(cluster, data, this._pending.get(cluster.id));
      const at = this._clusters.children[index];
      if (at !== view.node) {
        this._clusters.insertBefore(view.node, at ?? null);
      }
      index++;
    }
    for (const [id, view] of Array.from(this._views.entries())) {
      if (!seen.has(id)) {
        view.dispose();
        this._views.delete(id);
      }
    }
    this._empty.hidden = data.clusters.length > 0;

    this._renderGpus(data);
    this._renderCaps(data);
    this._renderOthers(data);
    this._renderQueue(data);
    this._renderSuspended(data);
  }

  private _renderGpus(data: IClustersReply): void {
    const gpus = data.gpus;
    this._nodeGpus.hidden = gpus === null || gpus === undefined;
    if (!gpus) {
      return;
    }
    const body = el('tbody');
    for (const gpu of gpus) {
      body.appendChild(this._gpuRow(gpu, data.user));
    }
    if (!gpus.length) {
      const row = el('tr');
      const td = el('td', 'hvd-none', 'no GPU found');
      td.colSpan = 5;
      row.appendChild(td);
      body.appendChild(row);
    }
    this._gpuTable.replaceChildren(body);
  }

  /** The node's caps and this user's share: under the GPUs where there are any, with or without a driver. */
  private _renderCaps(data: IClustersReply): void {
    const caps = data.caps;
    const lines: string[] = [];
    if (caps && caps.max_gpus_per_user !== null && caps.max_gpus_per_user !== undefined) {
      lines.push(
        `at most ${plural(caps.max_gpus_per_user, 'GPU')} per user; you hold ${caps.my_gpus}`
      );
    }
    if (caps && caps.max_ranks_per_user !== null && caps.max_ranks_per_user !== undefined) {
      lines.push(
        `at most ${plural(caps.max_ranks_per_user, 'CPU rank')} per user; you run ${caps.my_cpu_ranks}`
      );
    }
    this._caps.textContent = lines.join(' · ');
    this._caps.hidden = lines.length === 0;
  }

  private _gpuRow(gpu: INodeGpu, user: string): HTMLTableRowElement {
    const row = el('tr', 'hvd-node-gpu');
    row.dataset.index = `${gpu.index}`;
    row.appendChild(el('td', 'hvd-gpu-index', `${gpu.index}`));
    const name = el('td', 'hvd-gpu-name', gpu.name.replace(/^NVIDIA\s+/, ''));
    name.title = gpu.name;
    row.appendChild(name);
    row.appendChild(el('td', 'hvd-gpu-util hvd-num', formatPercent(gpu.util)));
    const memory = el(
      'td',
      'hvd-gpu-mem hvd-num',
      `${formatBytes(gpu.memory_used).replace(/ GiB$/, '')}/${formatBytes(gpu.memory_total)}`
    );
    memory.title = `${formatBytes(gpu.memory_used)} of ${formatBytes(gpu.memory_total)} used`;
    row.appendChild(memory);
    let holderText: string;
    let holderClass: string;
    if (gpu.mine || (gpu.holder !== null && gpu.holder === user)) {
      holderText = 'you';
      holderClass = 'hvd-gpu-mine';
    } else if (gpu.holder) {
      holderText = gpu.holder;
      holderClass = 'hvd-gpu-other';
    } else {
      holderText = 'free';
      holderClass = 'hvd-gpu-free';
    }
    row.classList.add(holderClass);
    row.dataset.holder = holderText;
    row.appendChild(el('td', `hvd-gpu-holder ${holderClass}`, holderText));
    return row;
  }

  private _renderOthers(data: IClustersReply): void {
    const others = data.others ?? [];
    this._others.hidden = others.length === 0;
    this._otherList.replaceChildren(
      ...others.map(other => {
        const parts = [plural(other.ranks, 'rank')];
        if (other.gpus && other.gpus.length) {
          parts.push(`${other.gpus.length === 1 ? 'GPU' : 'GPUs'} ${other.gpus.join(', ')}`);
        }
        parts.push(`since ${formatClock(other.since)}`);
        const line = el('div', 'hvd-other-lease', `${other.user}: ${parts.join(', ')}`);
        line.dataset.user = other.user;
        return line;
      })
    );
  }

  /** The node's queue for GPUs: one line per waiting start, in the order the node serves them. */
  private _renderQueue(data: IClustersReply): void {
    const waiting = data.queue ?? [];
    this._queue.hidden = waiting.length === 0;
    this._queueList.replaceChildren(
      ...waiting.map(entry => {
        const who = entry.mine ? `${entry.user} (you)` : entry.user;
        const wants = plural(entry.gpus, 'GPU');
        const since = formatClock(entry.since);
        const line = el(
          'div',
          entry.mine ? 'hvd-queue-entry hvd-queue-mine' : 'hvd-queue-entry',
          `${entry.place}. ${who}: ${wants}, waiting since ${since}`
        );
        line.dataset.user = entry.user;
        line.dataset.place = String(entry.place);
        return line;
      })
    );
  }

  /** This user's suspended clusters: id, ranks, size on disk, since when, the line that resumes it, and Delete.
   * Rebuilt only when what it shows changed, so that its buttons are not replaced under the pointer. */
  private _renderSuspended(data: IClustersReply): void {
    const suspended = data.suspended ?? [];
    this._suspended.hidden = suspended.length === 0;
    const key = JSON.stringify([suspended, Array.from(this._deleting)]);
    if (key === this._suspendedKey) {
      return;
    }
    this._suspendedKey = key;
    this._suspendedList.replaceChildren(...suspended.map(s => this._suspendedRow(s)));
  }

  private _suspendedRow(entry: ISuspended): HTMLElement {
    const row = el('div', 'hvd-suspended-entry');
    row.dataset.id = entry.id;
    const parts =
      entry.error !== null
        ? ['unreadable']
        : [
            plural(entry.ranks ?? 0, 'rank'),
            `${formatBytes(entry.bytes)} on disk`,
            entry.since !== null ? `since ${formatClock(entry.since)}` : ''
          ].filter(Boolean);
    const head = el('div', 'hvd-suspended-head');
    head.appendChild(el('span', 'hvd-suspended-id', entry.id));
    const meta = el('div', 'hvd-suspended-meta', parts.join(', '));
    if (entry.why) {
      meta.title = `suspended: ${entry.why}`;
    }
    const deleting = this._deleting.has(entry.id);
    const remove = el(
      'button',
      'jp-Button jp-mod-styled jp-mod-warn hvd-suspended-delete',
      deleting ? 'deleting…' : 'Delete'
    );
    remove.disabled = deleting;
    remove.title = "throw this cluster's saved state away (it can no longer be resumed)";
    remove.addEventListener('click', () => void this.deleteSuspended(entry));
    head.appendChild(remove);
    row.append(head, meta);
    if (entry.error !== null) {
      row.appendChild(el('div', 'hvd-suspended-error', entry.error));
      return row;
    }
    const line = `%hvd resume ${entry.id}`;
    const resume = el('div', 'hvd-suspended-resume');
    resume.appendChild(el('code', 'hvd-suspended-command', line));
    const copy = el(
      'button',
      'jp-Button jp-mod-styled jp-mod-reject hvd-suspended-copy',
      'Copy'
    );
    copy.title = 'copy the line that takes it back, to run in a notebook';
    copy.addEventListener('click', () => Clipboard.copyToSystem(line));
    resume.appendChild(copy);
    row.appendChild(resume);
    return row;
  }

  /** Asks, as for Stop, then throws a suspended cluster's state away; a notification says what was freed. */
  async deleteSuspended(entry: ISuspended): Promise<void> {
    if (this._deleting.has(entry.id)) {
      return;
    }
    const ranks = entry.ranks !== null ? `${plural(entry.ranks, 'rank')}' ` : '';
    const result = await showDialog({
      title: `Delete the suspended cluster ${entry.id}?`,
      body:
        `The saved state of its ${ranks}variables (${formatBytes(entry.bytes)} on disk) is thrown away: ` +
        `%hvd resume ${entry.id} can no longer take it back.`,
      buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Delete', displayType: 'warn' })]
    });
    if (!result.button.accept) {
      return;
    }
    this._deleting.add(entry.id);
    this._render();
    try {
      const reply = await deleteSuspended(entry.id);
      Notification.info(reply.text, { autoClose: 8000 });
    } catch (error) {
      await showErrorMessage(
        'hvd_notebook: delete failed',
        error instanceof Error ? error.message : String(error)
      );
    } finally {
      await this.model.refresh();
      this._deleting.delete(entry.id);
      this._render();
    }
  }

  private _views = new Map<string, ClusterView>();
  private _pending = new Map<string, ClusterAction>();
  private _error = el('div', 'hvd-error');
  private _loading = el('div', 'hvd-loading', 'asking the server…');
  private _empty = el('p', 'hvd-empty', 'No cluster: run %hvd start in a notebook.');
  private _clusters = el('div', 'hvd-clusters');
  private _nodeGpus = el('section', 'hvd-node-gpus');
  private _gpuTable = el('table', 'hvd-node-gpus-table');
  private _caps = el('div', 'hvd-caps');
  private _others = el('section', 'hvd-others');
  private _otherList = el('div', 'hvd-others-list');
  private _queue = el('section', 'hvd-queue');
  private _queueList = el('div', 'hvd-queue-list');
  private _suspended = el('section', 'hvd-suspended');
  private _suspendedList = el('div', 'hvd-suspended-list');
  private _suspendedKey = '';
  private _deleting = new Set<string>();
}

/** The stacks' text in a dialog: a scrollable monospace <pre class="hvd-stacks">, with a Copy button. */
export async function showStacks(name: string, text: string): Promise<void> {
  const body = new Widget();
  body.addClass('hvd-stacks-body');
  const pre = el('pre', 'hvd-stacks', text || '(no stack came back)');
  body.node.appendChild(pre);
  const copy = Dialog.createButton({
    label: 'Copy',
    className: 'hvd-stacks-copy',
    accept: false
  });
  const result = await showDialog({
    title: `Where is every rank? — ${name}`,
    body,
    buttons: [copy, Dialog.okButton({ label: 'Close' })]
  });
  if (result.button.label === 'Copy') {
    Clipboard.copyToSystem(text);
  }
}
