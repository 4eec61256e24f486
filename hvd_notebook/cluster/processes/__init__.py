"""Process hygiene: PIDs, cluster directories, the reaper, the rank watcher, stacks (see ``hvd_notebook.cluster``).

Nothing is imported here: a rank starts its watcher (``rankwatch``) without the rest of the layer."""
