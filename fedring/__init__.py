"""fedring: Byzantine-robust federated learning and federated conformal prediction over MPI."""

__version__ = "0.3.0"
