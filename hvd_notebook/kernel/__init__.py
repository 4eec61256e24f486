"""The notebook kernel's side: ``%hvd``/``%%hvd`` (``magics``), the session
that owns this kernel's cluster (``session``), one running cell (``cell``),
how cells fail (``failures``), and the cluster as the node sees it: its card
and the watch of the node's rules (``tenancy``). The kernel never imports a training framework
or touches a GPU."""
