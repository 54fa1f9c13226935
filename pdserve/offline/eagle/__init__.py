"""EAGLE head training (``pdserve train-eagle``): distillation data, target features,
the trainer and the acceptance estimate that judges a head."""
