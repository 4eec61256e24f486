"""What runs inside each rank besides the user's code: the bootstrap that pins
the device and initialises the runtime (``bootstrap``), and the progress
reporter that feeds the notebook's dashboard (``reporter``, with its adapters
``keras_progress``, ``custom_loops`` and ``tqdm_bars``)."""
