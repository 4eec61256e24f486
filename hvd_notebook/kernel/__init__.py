"""The notebook kernel's side: ``%hvd``/``%%hvd`` (``magics``), the session
that owns this kernel's cluster (``session``), one running cell (``cell``) and
how cells fail (``failures``). The kernel never imports a training framework
or touches a GPU."""
