"""CFD recipe data: a 2-D Navier–Stokes solver and the HDF5 datasets it writes."""
