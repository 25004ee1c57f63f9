"""k3mk: an ahead-of-time compiler of the Kimi K3 / Kimi Linear decode step into one persistent
GPU megakernel (CuTe DSL), and the small runtime that loads it. See docs/ and README.md."""

__version__ = "0.1.0"
