"""An in-process Kubernetes API emulator (kmock-based) for operator tests; see tests/kube/emulator/."""
