from verl_fastsync import hookimpl
from verl_fastsync.cleanup import CleanupContext, CleanupOutcome


def _empty_twice(ctx: CleanupContext) -> CleanupOutcome:
    ctx.device.empty_cache()
    ctx.device.empty_cache()
    return CleanupOutcome()


@hookimpl
def pre_resume_cleanup():
    return {"twice": _empty_twice}


@hookimpl
def post_transfer_cleanup():
    return {"twice": _empty_twice}
