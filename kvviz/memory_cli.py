def add_memory_arguments(p):
    p.add_argument("--json", action="store_true")

def run_memory(args):
    raise NotImplementedError
