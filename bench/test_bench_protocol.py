"""Unit tests of bench/bench_protocol.py on recorded /proc samples (the same samples as
trainer/tests/bench_protocol.rs). Plain Python, no torch:

    python3 -m unittest bench/test_bench_protocol.py
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_protocol as p  # noqa: E402

STAT_A = "cpu  3687880 1501608 632121 1013379 116045 0 6011 9720 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
STAT_B = "cpu  3688000 1501610 632144 1013399 116055 0 6016 9726 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
SELF_A = "15081 (py thon) x) R 15033 15033 12946 0 -1 4194304 101 0 0 0 500 40 3 1 20 0 1 0 3494734"
SELF_B = "15081 (py thon) x) R 15033 15033 12946 0 -1 4194304 101 0 0 0 620 66 5 3 20 0 1 0 3494734"


class Protocol(unittest.TestCase):
    def test_shares(self):
        a, b = p.parse_times(STAT_A, SELF_A), p.parse_times(STAT_B, SELF_B)
        self.assertEqual(a[3], 544)
        self.assertEqual((b[0] - a[0], b[2] - a[2]), (150, 186))
        other, steal = p.share_between(a, b)
        self.assertEqual(other, 0.0)
        self.assertAlmostEqual(steal, 6 / 186, places=12)
        other, _ = p.share_between(a, b[:3] + (a[3],))
        self.assertAlmostEqual(other, 150 / 186, places=12)
        self.assertEqual(p.share_between(a, a), (0.0, 0.0))

    def test_bad_samples(self):
        with self.assertRaisesRegex(ValueError, "/proc/stat"):
            p.parse_times("intr 1\n", SELF_A)
        with self.assertRaisesRegex(ValueError, "/proc/self/stat"):
            p.parse_times(STAT_A, "1 (cat) R 1 2")

    def test_rerun_rule(self):
        self.assertEqual(p.rerun(lambda: (1.0, (0.01, 0.0))), (1.0, (0.01, 0.0), 1))
        self.assertEqual(p.rerun(lambda: (1.0, (0.02, 0.0)))[2], 1)
        it = iter(enumerate([0.3, 0.05, 0.015, 0.0]))

        def nxt():
            i, l = next(it)
            return float(i), (l, 0.0)

        self.assertEqual(p.rerun(nxt), (2.0, (0.015, 0.0), 3))
        loads = iter([0.5, 0.1, 0.04, 0.3, 0.2, 0.09])
        n = [0]

        def over():
            n[0] += 1
            return float(n[0]), (next(loads), 0.01)

        self.assertEqual(p.MAX_RERUNS, 5)
        self.assertEqual(p.rerun(over), (3.0, (0.04, 0.01), 6))

    def test_cpu_line(self):
        info = (
            "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
            "flags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_tile amx_bf16\n\n"
            "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        )
        line = p.cpu_line(info)
        self.assertTrue(line.startswith("Intel(R) Xeon(R) Platinum 8480+ | 2 CPUs | "), line)
        self.assertIn("avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 |", line)
        self.assertTrue(line.endswith("absent: avx512_vnni avx_vnni avx512_fp16 amx_int8"), line)
        self.assertTrue(p.cpu_line("").startswith("unknown CPU | 0 CPUs"))


if __name__ == "__main__":
    unittest.main()
