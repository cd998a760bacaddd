"""What the MPI launcher tells a process before MPI starts (importing this module starts no MPI)."""

from __future__ import annotations

import os


def launched_ranks() -> tuple[int, int]:
    """(rank, size) from the MPI launcher's environment, without starting MPI (MPICH, Open MPI, PMIx)."""
    for rank_var, size_var in (
        ("PMI_RANK", "PMI_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
    ):
        if size_var in os.environ:
            return int(os.environ.get(rank_var, "0")), int(os.environ[size_var])
    return 0, 1
