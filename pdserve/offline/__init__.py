"""Offline tools, outside the serving runtime: EAGLE head training and its data
(:mod:`pdserve.offline.eagle`) and quantized-checkpoint authoring
(:mod:`pdserve.offline.quantize`). They build on the engine; nothing that serves requests
imports them."""
