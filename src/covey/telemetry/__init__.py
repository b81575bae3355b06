"""What a run shows and writes, from the numbers and texts it is handed (it never sees the trainer):

    runlog.py    metrics.jsonl, completions.jsonl, the progress bar; the configs a run folder keeps
    health.py    warnings in plain words when a run is not learning
    hacking.py   reward hacking and collapse, with evidence (trends.py: robust trends; text_signals.py: degenerate text)
    diagnose.py  ``covey diagnose``: the rules over a covey or TRL run folder, and one verdict
    trackers.py  TensorBoard, Weights & Biases, Trackio, MLflow
    tables.py    completion tables, the before/after evaluation, the model card
    report.py    ``covey report`` and ``covey compare``: plots and one HTML page of a run folder
"""
