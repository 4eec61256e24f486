"""The notebook kernel's side: ``%hvd``/``%%hvd`` (``magics``) and the session
that owns this kernel's cluster and runs cells on its ranks (``session``).
The kernel never imports a training framework or touches a GPU."""
