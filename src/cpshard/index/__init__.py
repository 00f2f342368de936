"""Pure index math over a plan's segments, below the plan: the segments themselves, the shift and
halo exchanges, the relayout route, and the causal-work arithmetic of the balanced order. NumPy and
torch on the CPU; no plan object is built or named here."""
