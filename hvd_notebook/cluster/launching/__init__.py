"""A cluster's worlds and how they start, run and end (see ``hvd_notebook.cluster``)."""
