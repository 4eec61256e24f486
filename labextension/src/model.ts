// One poller of GET hvd-notebook/clusters shared by the sidebar panel and the status-bar item.
//
// Its interval: 1.5 s while the panel is visible or the notebook in focus has a kernel (and the browser
// tab is visible), else 10 s; 5 s instead of 1.5 s while the server does not answer (a missing server
// extension is not asked 40 times a minute). Never two requests at once: the next one is scheduled when
// the last one has ended. A poll runs at once when the panel is shown, when the notebook in focus or its
// kernel changes, when the tab becomes visible again, and after every action.

import { IDisposable } from '@lumino/disposable';
import { ISignal, Signal } from '@lumino/signaling';

import { fetchClusters, ICluster, IClustersReply } from './api';

export const FAST_INTERVAL_MS = 1500;
export const SLOW_INTERVAL_MS = 10000;
export const ERROR_INTERVAL_MS = 5000;
/** Samples kept per rank for the sparklines. */
export const HISTORY_LENGTH = 60;

export interface IRankHistory {
  cpu: (number | null)[];
  gpu: (number | null)[];
}

export class ClusterModel implements IDisposable {
  constructor() {
    document.addEventListener('visibilitychange', this._onVisibility);
  }

  /** Emitted after every poll, whether it succeeded or not, and when a view's inputs change. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** The last successful answer (kept while later polls fail), or null before the first one. */
  get data(): IClustersReply | null {
    return this._data;
  }

  /** Why the last poll failed, or null when it succeeded. */
  get error(): string | null {
    return this._error;
  }

  /** Whether a poll has ended, successfully or not. */
  get answered(): boolean {
    return this._answered;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  /** The interval the poller waits after this poll, from what is on screen now. */
  get interval(): number {
    const wanted =
      (this._panelVisible || this._focusKernel !== null) && !document.hidden;
    if (!wanted) {
      return SLOW_INTERVAL_MS;
    }
    return this._error !== null ? ERROR_INTERVAL_MS : FAST_INTERVAL_MS;
  }

  get panelVisible(): boolean {
    return this._panelVisible;
  }

  /** Set by the panel when it is shown or hidden; showing it polls at once. */
  set panelVisible(visible: boolean) {
    if (visible === this._panelVisible) {
      return;
    }
    this._panelVisible = visible;
    if (visible) {
      void this.refresh();
    } else {
      this._schedule();
    }
  }

  /** The kernel id of the notebook in focus, or null (no notebook, or no kernel). */
  get focusKernel(): string | null {
    return this._focusKernel;
  }

  set focusKernel(id: string | null) {
    if (id === this._focusKernel) {
      return;
    }
    this._focusKernel = id;
    this._changed.emit();
    if (id !== null) {
      void this.refresh();
    } else {
      this._schedule();
    }
  }

  /** The cluster owned by that kernel, if any. */
  clusterForKernel(kernelId: string | null): ICluster | null {
    if (!kernelId || !this._data) {
      return null;
    }
    return this._data.clusters.find(c => c.kernel_id === kernelId) ?? null;
  }

  /** The last HISTORY_LENGTH samples of a rank's CPU % and GPU util (null: no sample). */
  history(clusterId: string, rank: number): IRankHistory {
    return (
      this._history.get(clusterId)?.get(rank) ?? {
        cpu: [],
        gpu: []
      }
    );
  }

  /** Starts polling. */
  start(): void {
    if (!this._started) {
      this._started = true;
      void this.refresh();
    }
  }

  /**
   * Polls now; while a poll is in flight, once more right after it (so that what an action changed is
   * seen), never two at once. Resolves when a poll that began after this call has ended.
   */
  refresh(): Promise<void> {
    const done = new Promise<void>(resolve => this._waiting.push(resolve));
    if (this._disposed || !this._started) {
      this._release(this._waiting.splice(0));
    } else if (this._inFlight) {
      this._again = true;
    } else {
      void this._poll();
    }
    return done;
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    window.clearTimeout(this._timer);
    this._release(this._waiting.splice(0));
    document.removeEventListener('visibilitychange', this._onVisibility);
    Signal.clearData(this);
  }

  private async _poll(): Promise<void> {
    window.clearTimeout(this._timer);
    this._timer = undefined;
    this._inFlight = true;
    const waiting = this._waiting.splice(0);
    try {
      const data = await fetchClusters();
      this._data = data;
      this._error = null;
      this._record(data);
    } catch (error) {
      this._error = error instanceof Error ? error.message : String(error);
    } finally {
      this._inFlight = false;
      this._answered = true;
    }
    if (this._disposed) {
      this._release(waiting);
      return;
    }
    this._changed.emit();
    this._release(waiting);
    if (this._again) {
      this._again = false;
      void this._poll();
    } else {
      this._schedule();
    }
  }

  /** (Re)arms the timer for the next poll with the interval wanted now; nothing while a poll is in flight. */
  private _schedule(): void {
    if (this._disposed || !this._started || this._inFlight) {
      return;
    }
    window.clearTimeout(this._timer);
    this._timer = window.setTimeout(() => {
      this._timer = undefined;
      void this.refresh();
    }, this.interval);
  }

  private _release(waiting: (() => void)[]): void {
    for (const resolve of waiting) {
      resolve();
    }
  }

  /** Appends this answer's samples to the sparklines' history; forgets clusters and ranks that are gone. */
  private _record(data: IClustersReply): void {
    const keep = new Map<string, Map<number, IRankHistory>>();
    for (const cluster of data.clusters) {
      const old = this._history.get(cluster.id);
      const ranks = new Map<number, IRankHistory>();
      for (const rank of cluster.ranks) {
        const h = old?.get(rank.rank) ?? { cpu: [], gpu: [] };
        h.cpu.push(rank.alive ? rank.cpu_percent : null);
        h.gpu.push(rank.alive && rank.gpu ? rank.gpu.util : null);
        if (h.cpu.length > HISTORY_LENGTH) {
          h.cpu.splice(0, h.cpu.length - HISTORY_LENGTH);
        }
        if (h.gpu.length > HISTORY_LENGTH) {
          h.gpu.splice(0, h.gpu.length - HISTORY_LENGTH);
        }
        ranks.set(rank.rank, h);
      }
      keep.set(cluster.id, ranks);
    }
    this._history = keep;
  }

  private _onVisibility = (): void => {
    if (!document.hidden && (this._panelVisible || this._focusKernel)) {
      void this.refresh();
    } else {
      this._schedule();
    }
  };

  private _changed = new Signal<this, void>(this);
  private _data: IClustersReply | null = null;
  private _error: string | null = null;
  private _answered = false;
  private _history = new Map<string, Map<number, IRankHistory>>();
  private _panelVisible = false;
  private _focusKernel: string | null = null;
  private _inFlight = false;
  private _again = false;
  private _waiting: (() => void)[] = [];
  private _started = false;
  private _disposed = false;
  private _timer: number | undefined = undefined;
}
