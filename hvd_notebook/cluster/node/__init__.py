"""The node shared with other users, and its security (see ``hvd_notebook.cluster``)."""
