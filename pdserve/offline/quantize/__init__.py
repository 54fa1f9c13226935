"""Quantized-checkpoint authoring (``pdserve quantize``): calibration data, AWQ scale
search and the checkpoint writer. Loading and running quantized layers stays in
:mod:`pdserve.engine.quantization`."""
