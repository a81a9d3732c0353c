"""Starting a job: the run's options, torchrun's command line, the network check, the job's
output and terminal, SLURM, NCCL debug files and native stacks of stuck ranks."""
