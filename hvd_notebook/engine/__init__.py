"""What runs inside each rank besides the user's code: the bootstrap that pins
the device and initialises the runtime (``bootstrap``), and the progress
reporter that feeds the notebook's dashboard (``progress``, with the Keras
``ProgressCallback`` in ``callback``)."""
