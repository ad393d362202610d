"""A stream does not keep its prompt's logits: the prefill's answer (T x vocabulary floats, 25 MB for a 128-token
prompt of a 49k vocabulary) is dropped once its first token is picked, so 32 open streams do not hold 32 of them."""

import gc
import weakref

from service.executor import Executor
from service.sampling import SamplingParams
from tests.serving import start


def test_an_open_stream_holds_no_reference_to_its_prompts_logits(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root)
    try:
        engine, refs = srv.registry.engine("rope"), []

        class Recording(Executor):  # a weak reference to each prompt call's logits, which the job's result carries
            def run(self, jobs):
                results = super().run(jobs)
                refs.extend(weakref.ref(r.logits) for r in results)
                return results

        engine.use(Recording(engine.executor.model, engine.executor.stats))
        stream = srv.ops.generate("rope", [("abcdefgh", None)], SamplingParams(max_new_tokens=40, ignore_eos=True))
        _, generation = next(stream)  # the prompt has run
        _, first = next(stream)  # its first token
        _, second = next(stream)  # from the decode loop: the stream is open
        gc.collect()
        assert len(refs) == 1  # one prefill, recorded when it finished
        assert refs[0]() is None, "the open stream still holds its prompt's logits"
        rest = [item for _, item in stream]
        assert 2 + len(rest) == 40 and rest[-1].reason == "length" and generation.generated == 40
    finally:
        srv.stop(grace=1)
