# Diagnostics only (device run): full-collection pauses and timestamped log lines, per process.
import gc, logging, os, time
_path = os.environ.get("DIAG_LOG")
if _path:
    _t = [0.0]
    def _cb(phase, info):
        if phase == "start":
            _t[0] = time.perf_counter()
        else:
            d = time.perf_counter() - _t[0]
            if d > 0.003:
                with open(_path, "a") as f:
                    f.write(f"{time.time():.4f} pid {os.getpid()} gc gen{info['generation']} {d*1e3:.1f} ms "
                            f"collected {info['collected']} frozen {gc.get_freeze_count()}\n")
    gc.callbacks.append(_cb)
    _bc = logging.basicConfig
    def basicConfig(**kw):
        kw["format"] = "%(created).4f %(process)d " + kw.get("format", "%(levelname)s %(name)s: %(message)s")
        _bc(**kw)
    logging.basicConfig = basicConfig
