"""What a sweep costs and how many seeds it needs: the cost model (`cost`), applied to a sweep and
calibrated on measured steps (`costing`), the hours spent beside the prediction (`spent`), the sequential
seed rule (`seeds`) and the declared collapse rule that stops a run early (`collapse`)."""
