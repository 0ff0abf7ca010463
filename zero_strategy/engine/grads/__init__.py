"""Gradients from backward to the step: the reducer (reduce-scatter or all-reduce per segment),
accumulation without communication, hybrid sharding's deferred replica sum, the loss scaler.
"""
