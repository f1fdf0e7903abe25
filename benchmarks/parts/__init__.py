"""Code of the scripts' larger subcommands, imported by the scripts beside this folder (which put benchmarks/ on
sys.path). A folder rather than more scripts: benchmarks/ holds one script per README claim, at most 15, and a
script that takes in another's subcommands would pass 600 lines."""
