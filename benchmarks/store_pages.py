"""Store pages: a page of a long conversation's items, cut in the store's actor, against the whole list sent.

`GET /v1/conversations/{id}/items` (and a response's `input_items`) answers a
page of 20; the store (cluster/response_store.py, a Ray actor) cuts it there
(`conversation_items`, cluster/item_pages.py), so only the page crosses to the
scheduler replica. Before, the replica asked for the whole conversation
(`get_conversation`) and cut the page itself. This keeps conversations of
`--sizes` items of about 0.6 KB each in one store actor and times both calls
side by side, alternating, `--repeats` times each (medians); no model, no HTTP.

    tandem bench store-pages       # about 20 s
"""

from __future__ import annotations

import argparse
import time

from benchmarks import report
from benchmarks.arguments import positive_int

TEXT = "x" * 500


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[100, 2000, 10000],
                        help="items of each conversation")
    parser.add_argument("--repeats", type=positive_int, default=30)


def _items(size: int) -> list[dict]:
    return [{"type": "message", "id": f"msg_{size}_{k}", "role": "user", "status": "completed",
             "content": [{"type": "input_text", "text": TEXT}]} for k in range(size)]


def main(args: argparse.Namespace) -> None:
    import ray

    from cluster.item_pages import items_page
    from cluster.response_store import ResponseStore

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    store = ray.remote(ResponseStore).remote(max_bytes=1 << 31)
    rows, results = [], []
    for size in args.sizes:
        conversation_id = f"conv_{size}"
        ray.get(store.create_conversation.remote(
            {"id": conversation_id, "object": "conversation", "created_at": 0, "metadata": {}}, _items(size)))
        whole_ms, page_ms = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            kept = ray.get(store.get_conversation.remote(conversation_id))
            items_page(kept.items, 20, "desc", None)
            whole_ms.append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            ray.get(store.conversation_items.remote(conversation_id, 20, "desc", None))
            page_ms.append((time.perf_counter() - started) * 1e3)
        whole, page = report.median(whole_ms), report.median(page_ms)
        results.append({"items": size, "whole_list_ms": whole, "page_ms": page, "ratio": report.ratio(whole, page)})
        rows.append([size, report.fmt(whole), report.fmt(page), report.fmt_ratio(report.ratio(whole, page))])
    ray.shutdown()
    report.print_table("A page of 20 items, median ms", ["items", "whole list sent", "page cut in the actor",
                                                         "whole / page"], rows)
    last = results[-1]
    report.finish("store-pages", args.out, {"sizes": results, "machine": report.machine_info()},
                  f"a page of a {last['items']}-item conversation takes {report.fmt(last['page_ms'])} ms, "
                  f"{report.fmt_ratio(last['ratio'])} faster than the whole list", "the page's time flat in the size")
