"""Process hygiene: PIDs, cluster directories, the reaper, stacks (see ``hvd_notebook.cluster``)."""
