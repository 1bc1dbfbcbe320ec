//! Backends: tensor storage and kernels.
