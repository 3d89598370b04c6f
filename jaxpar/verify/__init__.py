"""`jaxpar verify`: a layout against one device, step by step and tensor by tensor. run.py verify() (the
reference and the layout side by side); checks.py the judgement of gradients, updates and weights at the
precision policy's tolerances; ties.py Adam's near-ties; routing.py a mixture of experts' routing replayed;
local_sgd.py local SGD's replicas against a reference written apart."""
