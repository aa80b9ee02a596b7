def add_bench_arguments(p):
    p.add_argument("--json", action="store_true")

def run_bench(args):
    raise NotImplementedError
