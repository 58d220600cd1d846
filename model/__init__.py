"""megapar.model: a reference DeepSeek-V4-style block wiring mHC, attention (TP/SP, PCP, DCP) and the FP4 MoE."""
