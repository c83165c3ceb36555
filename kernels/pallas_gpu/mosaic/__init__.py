"""The Mosaic GPU (Hopper) lowering: the forward, the backward and the strip forward."""
