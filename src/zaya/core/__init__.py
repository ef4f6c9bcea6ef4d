"""The ground floor: what every other package shares (errors, devices and dtypes, the hardware profile, atomic
files, processes). Imports only torch and the standard library."""
