"""fedring's ports of ByzFL's rules and attacks against ByzFL's own outputs.

Reference: ByzFL 0.0.11 (``pip install --no-deps --target /tmp/byzfl byzfl==0.0.11``), whose
``byzfl/aggregators/aggregators.py``, ``byzfl/aggregators/preaggregators.py`` and
``byzfl/attacks/attacks.py`` are those of commit 69bd1ac0116fa7ff9eaf6d8ae049650d8e5f7e55 of
github.com/LPD-EPFL/byzfl (byte for byte, up to the wheel's CRLF line ends; aggregators.py is
unchanged since 0d01c0b, attacks.py since acce1a4). The vectors below were printed by ByzFL
itself on the inputs of this file (float64 unless noted), with ``repr`` precision; ByzFL is not
needed to run these tests, and none of its code is copied here.

ByzFL's ``SMEA`` and ``CAF`` start a single power-iteration step at ``np.random.randn``; for
the references that start was replaced by the exact top eigenvector of the matrix the step is
about to multiply (read from the caller's frame), so that ByzFL's step returns the exact
eigenpair, which is what fedring computes. Everything else ran unchanged.

Agreement (max abs difference): MDA, SMEA, MoNNA, Meamed, ARC <= 4.5e-16 on float64 input;
CAF (``variant="byzfl"``) <= 2e-11 (28 filtering steps compound the rounding); the optimal
attacks bit for bit, except where ByzFL's line search is decided by rounding (a plateau). Every
deliberate difference is tested below and documented in the docstrings and in docs/aggregators.md
("ByzFL's MDA, MoNNA, Meamed, CAF, SMEA and ARC") and docs/attacks.md ("ByzFL's optimal ALIE and
IPM").
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedring.aggregators import PRE_AGGREGATORS, make_aggregator
from fedring.aggregators.arc import arc_clipped
from fedring.aggregators.mda import mda_search_bound, min_diameter_subset
from fedring.attacks import AttackContext, make_attack
from fedring.attacks.optimal import byzfl_line_search
from fedring.errors import ConfigError

X_OUT = np.array(
    [
        [0.3, -1.2, 0.5, 2.0],
        [0.1, -0.9, 0.7, 1.8],
        [0.4, -1.1, 0.2, 2.2],
        [-0.2, -1.0, 0.6, 1.9],
        [0.0, -1.3, 0.4, 2.1],
        [9.0, 8.0, -7.0, -6.0],
    ]
)  # an outlier
X_GRID = np.array([[0.0, 0], [1, 0], [0, 1], [1, 1], [2, 0], [5, 5]])  # integer distances: exact ties
X_LINE = np.array([[0.0], [1], [2], [3], [4]])  # ties on a line
X_RAND = np.array(
    [
        [-2.22, 0.03, -0.54, -1.13, -2.44],
        [0.77, -0.76, 0.27, 0.7, 0.29],
        [-0.2, 0.66, 0.52, 0.6, -1.65],
        [-0.39, -0.68, 2.94, -0.66, 1.26],
        [-1.68, -0.4, -1.43, 0.19, 1.81],
        [-0.89, 0.79, 0.77, 0.64, -0.23],
        [1.72, 4.12, 4.68, 4.28, 9.24],
    ]
)  # normal draws rounded to 2 digits, the last one scaled and shifted
BYZFL = np.array([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]])  # ByzFL's docstring matrix
INPUTS = {"X_OUT": X_OUT, "X_GRID": X_GRID, "X_LINE": X_LINE, "X_RAND": X_RAND, "BYZFL": BYZFL}

#: ByzFL 0.0.11's outputs: (rule, input, f) -> vector; MoNNA (rule, input, f, idx)
BYZFL_RULES = {
    ("meamed", "X_OUT", 0): [1.5999999999999999, 0.4166666666666667, -0.7666666666666666, 0.6666666666666666],
    ("monna", "X_OUT", 0, 0): [1.5999999999999999, 0.4166666666666667, -0.7666666666666666, 0.6666666666666666],
    ("monna", "X_OUT", 0, 3): [1.5999999999999999, 0.4166666666666667, -0.7666666666666666, 0.6666666666666666],
    ("monna", "X_OUT", 0, 5): [1.6000000000000003, 0.4166666666666667, -0.7666666666666666, 0.6666666666666666],
    ("mda", "X_OUT", 1): [0.12000000000000002, -1.1, 0.48, 2.0],
    ("meamed", "X_OUT", 1): [0.12000000000000002, -1.1, 0.4800000000000001, 2.0],
    ("monna", "X_OUT", 1, 0): [0.11999999999999997, -1.1, 0.48, 2.0],
    ("monna", "X_OUT", 1, 3): [0.12, -1.1, 0.48, 2.0],
    ("monna", "X_OUT", 1, 5): [1.9200000000000004, 0.76, -1.0, 0.38],
    ("smea", "X_OUT", 1): [0.12000000000000002, -1.1, 0.48, 2.0],
    ("caf", "X_OUT", 1): [0.11542746188604273, -1.1120277976204747, 0.4866419081331946, 1.997497518260684],
    ("mda", "X_OUT", 2): [0.05, -1.1, 0.5499999999999999, 1.9499999999999997],
    ("meamed", "X_OUT", 2): [0.2, -1.05, 0.55, 1.9500000000000002],
    ("monna", "X_OUT", 2, 0): [0.19999999999999998, -1.125, 0.45, 2.025],
    ("monna", "X_OUT", 2, 3): [0.049999999999999996, -1.1, 0.5499999999999999, 1.9500000000000002],
    ("monna", "X_OUT", 2, 5): [2.45, 1.2, -1.4, 5.551115123125783e-17],
    ("smea", "X_OUT", 2): [0.05, -1.1, 0.5499999999999999, 1.9499999999999997],
    ("caf", "X_OUT", 2): [0.13072094426009662, -1.1986957137240293, 0.4677190195822706, 2.027608456154328],
    ("meamed", "X_GRID", 0): [1.5, 1.1666666666666667],
    ("monna", "X_GRID", 0, 0): [1.5, 1.1666666666666667],
    ("monna", "X_GRID", 0, 3): [1.5, 1.1666666666666667],
    ("monna", "X_GRID", 0, 5): [1.5, 1.1666666666666667],
    ("mda", "X_GRID", 1): [0.8, 0.4],
    ("meamed", "X_GRID", 1): [0.8, 0.4],
    ("monna", "X_GRID", 1, 0): [0.8, 0.4],
    ("monna", "X_GRID", 1, 3): [0.8, 0.4],
    ("monna", "X_GRID", 1, 5): [1.8, 1.4],
    ("smea", "X_GRID", 1): [0.8, 0.4],
    ("caf", "X_GRID", 1): [0.794347678974027, 0.42001252319928983],
    ("mda", "X_GRID", 2): [0.5, 0.5],
    ("meamed", "X_GRID", 2): [0.5, 0.5],
    ("monna", "X_GRID", 2, 0): [0.5, 0.5],
    ("monna", "X_GRID", 2, 3): [0.5, 0.5],
    ("monna", "X_GRID", 2, 5): [2.25, 1.5],
    ("smea", "X_GRID", 2): [0.5, 0.5],
    ("caf", "X_GRID", 2): [0.73211258489046, 0.48296916860034195],
    ("meamed", "X_LINE", 0): [2.0],
    ("monna", "X_LINE", 0, 0): [2.0],
    ("monna", "X_LINE", 0, 2): [2.0],
    ("monna", "X_LINE", 0, 4): [2.0],
    ("mda", "X_LINE", 1): [1.5],
    ("meamed", "X_LINE", 1): [1.5],
    ("monna", "X_LINE", 1, 0): [1.5],
    ("monna", "X_LINE", 1, 2): [1.5],
    ("monna", "X_LINE", 1, 4): [2.5],
    ("smea", "X_LINE", 1): [1.5],
    ("caf", "X_LINE", 1): [2.0],
    ("mda", "X_LINE", 2): [1.0],
    ("meamed", "X_LINE", 2): [2.0],
    ("monna", "X_LINE", 2, 0): [1.0],
    ("monna", "X_LINE", 2, 2): [2.0],
    ("monna", "X_LINE", 2, 4): [3.0],
    ("smea", "X_LINE", 2): [1.0],
    ("caf", "X_LINE", 2): [1.9999999999999996],
    ("meamed", "X_RAND", 0): [-0.4128571428571428, 0.5371428571428571, 1.03, 0.66, 1.182857142857143],
    ("monna", "X_RAND", 0, 0): [-0.4128571428571429, 0.5371428571428571, 1.03, 0.66, 1.1828571428571428],
    ("monna", "X_RAND", 0, 3): [-0.4128571428571428, 0.5371428571428571, 1.03, 0.66, 1.182857142857143],
    ("monna", "X_RAND", 0, 6): [-0.41285714285714287, 0.5371428571428573, 1.0299999999999998, 0.66, 1.1828571428571428],
    ("mda", "X_RAND", 1): [-0.7683333333333332, -0.05999999999999998, 0.4216666666666667, 0.05666666666666667, -0.16],
    ("meamed", "X_RAND", 1): [-0.7683333333333332, -0.06, 0.4216666666666667, 0.05666666666666664, -0.16],
    ("monna", "X_RAND", 1, 0): [
        -0.7683333333333334,
        -0.06000000000000002,
        0.4216666666666667,
        0.056666666666666664,
        -0.16000000000000003,
    ],
    ("monna", "X_RAND", 1, 3): [
        -0.7683333333333332,
        -0.06,
        0.4216666666666667,
        0.05666666666666664,
        -0.15999999999999995,
    ],
    ("monna", "X_RAND", 1, 6): [
        -0.11166666666666665,
        0.6216666666666668,
        1.2916666666666663,
        0.9583333333333334,
        1.7866666666666664,
    ],
    ("smea", "X_RAND", 1): [-0.7683333333333332, -0.05999999999999998, 0.4216666666666667, 0.05666666666666667, -0.16],
    ("caf", "X_RAND", 1): [
        -0.6769635876619551,
        -0.04925618619000345,
        0.3885851715128698,
        0.1803791487087287,
        1.2697832725893373e-05,
    ],
    ("mda", "X_RAND", 2): [-0.844, 0.06400000000000002, -0.08199999999999999, 0.2, -0.44399999999999995],
    ("meamed", "X_RAND", 2): [-0.4779999999999999, 0.08, -0.08199999999999999, 0.29399999999999993, 0.296],
    ("monna", "X_RAND", 2, 0): [
        -0.8440000000000001,
        0.06399999999999999,
        -0.08199999999999999,
        0.2,
        -0.44400000000000006,
    ],
    ("monna", "X_RAND", 2, 3): [
        -0.4779999999999999,
        -0.078,
        0.6140000000000001,
        0.29399999999999993,
        0.29600000000000004,
    ],
    ("monna", "X_RAND", 2, 6): [-0.094, 0.6140000000000001, 1.4459999999999997, 1.03, 2.4739999999999998],
    ("smea", "X_RAND", 2): [
        -0.47800000000000004,
        -0.07800000000000003,
        0.614,
        0.29399999999999993,
        0.29600000000000004,
    ],
    ("caf", "X_RAND", 2): [
        -0.40457758581603215,
        -0.03083757844426734,
        0.519383266519105,
        0.3756773333771132,
        0.07815966855072372,
    ],
    ("mda", "X_RAND", 3): [-0.1775, 0.0025000000000000022, 1.125, 0.31999999999999995, -0.08249999999999996],
    ("meamed", "X_RAND", 3): [-0.1775, -0.0975, 0.255, 0.5325, 0.7825],
    ("monna", "X_RAND", 3, 0): [-0.6350000000000001, 0.18, 0.255, 0.2025, -1.0075],
    ("monna", "X_RAND", 3, 3): [-0.1775, 0.0025000000000000022, 1.125, 0.31999999999999995, -0.08249999999999996],
    ("monna", "X_RAND", 3, 6): [0.3025, 0.8675000000000002, 2.1649999999999996, 1.24, 2.6399999999999997],
    ("smea", "X_RAND", 3): [-0.1775, 0.0025000000000000022, 1.125, 0.31999999999999995, -0.08249999999999996],
    ("caf", "X_RAND", 3): [
        -0.2654553612677871,
        -0.07425694547152434,
        0.5496716273570789,
        0.4724971903642821,
        0.23143975037162665,
    ],
    ("mda", "BYZFL", 0): [4.0, 5.0, 6.0],
    ("meamed", "BYZFL", 0): [4.0, 5.0, 6.0],
    ("monna", "BYZFL", 0, 0): [4.0, 5.0, 6.0],
    ("monna", "BYZFL", 0, 1): [4.0, 5.0, 6.0],
    ("monna", "BYZFL", 0, 2): [4.0, 5.0, 6.0],
    ("mda", "BYZFL", 1): [2.5, 3.5, 4.5],
    ("meamed", "BYZFL", 1): [2.5, 3.5, 4.5],
    ("monna", "BYZFL", 1, 0): [2.5, 3.5, 4.5],
    ("monna", "BYZFL", 1, 1): [2.5, 3.5, 4.5],
    ("monna", "BYZFL", 1, 2): [5.5, 6.5, 7.5],
    ("smea", "BYZFL", 1): [2.5, 3.5, 4.5],
    ("caf", "BYZFL", 1): [4.0, 5.0, 6.0],
}

#: ByzFL 0.0.11's ``ARC(f)`` on the inputs: the whole (n, d) output, row by row
BYZFL_ARC = {
    ("arc", "X_OUT", 1): [
        0.3,
        -1.2,
        0.5,
        2.0,
        0.1,
        -0.9,
        0.7,
        1.8,
        0.4,
        -1.1,
        0.2,
        2.2,
        -0.2,
        -1.0,
        0.6,
        1.9,
        0.0,
        -1.3,
        0.4,
        2.1,
        1.4847924756181161,
        1.31981553388277,
        -1.1548385921474238,
        -0.9898616504120774,
    ],
    ("arc", "X_OUT", 2): [
        0.3,
        -1.2,
        0.5,
        2.0,
        0.1,
        -0.9,
        0.7,
        1.8,
        0.4,
        -1.1,
        0.2,
        2.2,
        -0.2,
        -1.0,
        0.6,
        1.9,
        0.0,
        -1.2989612463383262,
        0.39968038348871576,
        2.098322013315758,
        1.4836060651405207,
        1.318760946791574,
        -1.1539158284426272,
        -0.9890707100936804,
    ],
    ("arc", "X_OUT", 3): [
        0.3,
        -1.2,
        0.5,
        2.0,
        0.1,
        -0.9,
        0.7,
        1.8,
        0.3846660889654819,
        -1.0578317446550751,
        0.19233304448274094,
        2.1156634893101502,
        -0.2,
        -1.0,
        0.6,
        1.9,
        0.0,
        -1.2491658558667296,
        0.3843587248820706,
        2.0178833056308707,
        1.42673235660768,
        1.2682065392068267,
        -1.1096807218059734,
        -0.95115490440512,
    ],
    ("arc", "X_GRID", 1): [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 0.0, 1.414213562373095, 1.414213562373095],
    ("arc", "X_GRID", 2): [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.4142135623730951, 0.0, 1.0, 1.0],
    ("arc", "X_GRID", 3): [
        0.0,
        0.0,
        1.0,
        0.0,
        0.0,
        1.0,
        0.7071067811865475,
        0.7071067811865475,
        1.0,
        0.0,
        0.7071067811865475,
        0.7071067811865475,
    ],
    ("arc", "X_LINE", 1): [0.0, 1.0, 2.0, 3.0, 3.0],
    ("arc", "X_LINE", 2): [0.0, 1.0, 2.0, 2.0, 2.0],
    ("arc", "X_LINE", 3): [0.0, 1.0, 2.0, 2.0, 2.0],
    ("arc", "X_RAND", 1): [
        -2.22,
        0.03,
        -0.54,
        -1.13,
        -2.44,
        0.77,
        -0.76,
        0.27,
        0.7,
        0.29,
        -0.2,
        0.66,
        0.52,
        0.6,
        -1.65,
        -0.39,
        -0.68,
        2.94,
        -0.66,
        1.26,
        -1.68,
        -0.4,
        -1.43,
        0.19,
        1.81,
        -0.89,
        0.79,
        0.77,
        0.64,
        -0.23,
        0.5031059855155645,
        1.2051143373977475,
        1.3689162861702568,
        1.251914894189893,
        2.7027321547464047,
    ],
    ("arc", "X_RAND", 2): [
        -2.113116572955381,
        0.028555629364261904,
        -0.5140013285567143,
        -1.0755953727205316,
        -2.322524521626635,
        0.77,
        -0.76,
        0.27,
        0.7,
        0.29,
        -0.2,
        0.66,
        0.52,
        0.6,
        -1.65,
        -0.39,
        -0.68,
        2.94,
        -0.66,
        1.26,
        -1.68,
        -0.4,
        -1.43,
        0.19,
        1.81,
        -0.89,
        0.79,
        0.77,
        0.64,
        -0.23,
        0.47888360177747263,
        1.1470932786762718,
        1.303008869952658,
        1.191640590469525,
        2.572607256060376,
    ],
    ("arc", "X_RAND", 3): [
        -1.816828309868081,
        0.024551733917136227,
        -0.44193121050845213,
        -0.9247819775454645,
        -1.9968743585937465,
        0.77,
        -0.76,
        0.27,
        0.7,
        0.29,
        -0.2,
        0.66,
        0.52,
        0.6,
        -1.65,
        -0.3353165887377256,
        -0.5846545649785985,
        2.5277712074074694,
        -0.5674588424792278,
        1.083330517460344,
        -1.68,
        -0.4,
        -1.43,
        0.19,
        1.81,
        -0.89,
        0.79,
        0.77,
        0.64,
        -0.23,
        0.4117374762832244,
        0.9862548850505143,
        1.120308947096215,
        1.0245560456350002,
        2.211892023754066,
    ],
    ("arc", "BYZFL", 1): [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 4.4100400914557945, 5.040045818806622, 5.670051546157449],
    ("arc", "BYZFL", 2): [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 4.4100400914557945, 5.040045818806622, 5.670051546157449],
    ("arc", "BYZFL", 3): [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
}

#: ByzFL on float32 input (it computes in float32): X_RAND as float32; MoNNA with idx = 3;
#: ARC: the last row (the one clipped)
BYZFL_FLOAT32 = {
    ("mda", 1): [
        -0.7683332562446594,
        -0.059999991208314896,
        0.4216667115688324,
        0.05666666105389595,
        -0.1600000411272049,
    ],
    ("meamed", 1): [
        -0.7683332562446594,
        -0.059999991208314896,
        0.4216667115688324,
        0.056666672229766846,
        -0.1600000262260437,
    ],
    ("monna", 1): [
        -0.7683332562446594,
        -0.059999991208314896,
        0.4216667115688324,
        0.056666672229766846,
        -0.1600000262260437,
    ],
    ("arc", 1): [0.5031060576438904, 1.2051143646240234, 1.368916392326355, 1.2519150972366333, 2.7027323246002197],
    ("smea", 1): [
        -0.7683332562446594,
        -0.059999991208314896,
        0.4216667115688324,
        0.05666666105389595,
        -0.1600000411272049,
    ],
    ("caf", 1): [
        -0.6769635745260297,
        -0.0492561733910854,
        0.3885851676459747,
        0.18037915734022267,
        1.2685165484337469e-05,
    ],
    ("mda", 2): [
        -0.843999981880188,
        0.06400000303983688,
        -0.0819999948143959,
        0.20000000298023224,
        -0.4440000653266907,
    ],
    ("meamed", 2): [
        -0.4779999852180481,
        0.08000000566244125,
        -0.0819999948143959,
        0.2939999997615814,
        0.2959999740123749,
    ],
    ("monna", 2): [
        -0.4779999852180481,
        -0.07799999415874481,
        0.6140000224113464,
        0.2939999997615814,
        0.2959999740123749,
    ],
    ("arc", 2): [0.47888365387916565, 1.1470932960510254, 1.3030089139938354, 1.1916407346725464, 2.5726072788238525],
    ("smea", 2): [
        -0.4779999852180481,
        -0.07799998670816422,
        0.6140000224113464,
        0.29399996995925903,
        0.2959999740123749,
    ],
    ("caf", 2): [
        -0.40457681254918565,
        -0.03083755650214902,
        0.5193845178647347,
        0.37567734949934783,
        0.07815902966432642,
    ],
}

#: ByzFL's Optimal_ALittleIsEnough / Optimal_InnerProductManipulation(agg, pre_agg_list, f=b) on
#: the honest rows: (attack, case) -> the vector every attacker sends
BYZFL_ATTACKS = {
    ("optimal_alie", "docstring"): [12.919851162664964, 13.919851162664964, 14.919851162664964],
    ("optimal_ipm", "docstring"): [-2.7487790694400016, -3.435973836800002, -4.123168604160003],
    ("optimal_alie", "default"): [
        5639867.020110335,
        3508416.351682601,
        7723046.3150865575,
        4053612.2841522945,
        8622313.602669114,
    ],
    ("optimal_ipm", "default"): [17.517999999999997, 1.3679999999999994, -9.614, -1.292, 3.648],
    ("optimal_alie", "median"): [
        9.98888129995658,
        6.631786009728644,
        15.152235788960164,
        7.788333153696915,
        16.285789734761902,
    ],
    ("optimal_ipm", "median"): [23.049999999999997, 1.7999999999999994, -12.65, -1.7000000000000002, 4.8],
    ("optimal_alie", "mda"): [
        1.0364278012773243,
        1.0626953931099559,
        2.8930460663431523,
        1.353825053595344,
        2.599145666706833,
    ],
    ("optimal_ipm", "mda"): [
        3.569489050337281,
        0.27874534883328,
        -1.9589603681894407,
        -0.2632594961203201,
        0.7433209302220803,
    ],
    ("optimal_alie", "meamed_arc"): [
        5639867.020110335,
        3508416.351682601,
        7723046.3150865575,
        4053612.2841522945,
        8622313.602669114,
    ],
    ("optimal_ipm", "meamed_arc"): [
        8.029359904702964,
        0.6270215977642227,
        -4.406568450954123,
        -0.5921870645550995,
        1.672057594037928,
    ],
    ("optimal_alie", "monna"): [
        -0.7683333333333332,
        -0.05999999999999998,
        0.4216666666666667,
        0.05666666666666667,
        -0.16,
    ],
    ("optimal_ipm", "monna"): [
        2.2304063404393544,
        0.17417489860263938,
        -1.2240624818463273,
        -0.16449851534693727,
        0.4644663962737052,
    ],
    ("optimal_alie", "trmean_nnm"): [0.563559328996634, -0.8062456582329497, 0.8373675806426062, 2.2937543417670505],
    ("optimal_ipm", "trmean_nnm"): [-0.0, 0.0, -0.0, -0.0],
}


def rule_output(rule: str, X: np.ndarray, f: int, idx: int | None = None) -> np.ndarray:
    if rule == "arc":
        return PRE_AGGREGATORS["arc"](f).transform(X, None)[0]
    params = {"idx": idx} if rule == "monna" else {"variant": "byzfl"} if rule == "caf" else {}
    return make_aggregator(rule, f, params)(X)


# --------------------------------------------------------------------------------------
# the rules against ByzFL
# --------------------------------------------------------------------------------------

#: documented differences (docs/aggregators.md): Meamed's tie at the boundary
DIFFERENT = {("meamed", "X_GRID", 2)}


@pytest.mark.parametrize("key", [k for k in BYZFL_RULES if k not in DIFFERENT], ids=str)
def test_rule_matches_byzfl(key):
    rule, name, f, *idx = key
    got = rule_output(rule, INPUTS[name], f, *idx)
    # CAF: up to 28 filtering steps, each scaling weights by 1 - tau_i / tau_max, compound rounding
    atol = 1e-10 if rule == "caf" else 1e-15
    np.testing.assert_allclose(got, BYZFL_RULES[key], rtol=1e-12, atol=atol)


@pytest.mark.parametrize("key", list(BYZFL_ARC), ids=str)
def test_arc_matches_byzfl(key):
    _, name, f = key
    X = INPUTS[name]
    got = rule_output("arc", X, f)
    assert got.shape == X.shape
    np.testing.assert_allclose(got.ravel(), BYZFL_ARC[key], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("key", list(BYZFL_FLOAT32), ids=str)
def test_float32_input_matches_byzfl_in_float32(key):
    rule, f = key
    X = X_RAND.astype(np.float32)
    got = rule_output(rule, X, f, 3)
    assert got.dtype == np.float32
    if rule == "arc":
        got = got[-1]
    # both sides round to float32 (fedring sums Gram blocks in float64); CAF iterates on it
    np.testing.assert_allclose(got, BYZFL_FLOAT32[key], rtol=0, atol=5e-5 if rule == "caf" else 5e-7)


def test_meamed_keeps_the_lower_of_two_equally_close_values_in_any_row_order():
    """Column 0 of X_GRID: median 1, the four closest are 1, 1 and two of 0, 0, 2 (all at 1);
    column 1: median 0.5, four of 0, 0, 0, 1, 1 (all at 0.5). ByzFL keeps what
    ``np.argpartition`` places first, which depends on the row order."""
    byzfl = {"as given": [0.5, 0.5], "reversed": [1.0, 0.5]}  # ByzFL 0.0.11's Meamed(2)
    assert BYZFL_RULES["meamed", "X_GRID", 2] == byzfl["as given"]
    for X in (X_GRID, X_GRID[::-1]):
        np.testing.assert_array_equal(make_aggregator("meamed", 2, {})(X), [0.5, 0.25])


def test_arc_counts_the_clipped_rows_in_integers():
    """(n, f) = (121, 66): k = 2 * 66 * 55 / 121 = 60 exactly, ByzFL's float formula gives 59."""
    assert arc_clipped(121, 66) == 60 and int((2 * 66 / 121) * (121 - 66)) == 59
    X = np.array([[3.0 * (i + 1) / 5, 4.0 * (i + 1) / 5] for i in range(121)])  # norms 1 .. 121
    norms = np.linalg.norm(rule_output("arc", X, 66), axis=1)
    np.testing.assert_allclose(norms, np.minimum(np.arange(1, 122), 61), rtol=1e-15)
    # ByzFL's ARC(66) on this X clips 59 rows, to norm 62.00000000000002


# --------------------------------------------------------------------------------------
# CAF: the weighted variant, and the cases ByzFL leaves undefined
# --------------------------------------------------------------------------------------

X_FAR = np.array([[i % 3, (i // 3) % 3, (7 * i) % 5] for i in range(9)] + [[1000, 0, 0]], dtype=float)


def count_eighs(monkeypatch) -> list[int]:
    import fedring.aggregators.caf as caf

    calls = [0]
    eigh = np.linalg.eigh

    def counted(M):
        calls[0] += 1
        return eigh(M)

    monkeypatch.setattr(caf.np.linalg, "eigh", counted)
    return calls


def test_caf_default_scales_by_the_weighted_rows_and_stops_within_n_steps(monkeypatch):
    """ByzFL (exact eigenvector) takes 74,384 steps on X_FAR with f = 4 and returns
    (0.58357803, 1.19207631, 1.57279536); with its random power step, seeds 0 and 1 give
    (0.64139467, 1.27954208, 1.58745525) and (0.56916243, 1.335766, 1.55774754)."""
    calls = count_eighs(monkeypatch)
    res = make_aggregator("caf", 4, {}).aggregate(X_FAR)
    assert calls[0] <= 10
    np.testing.assert_allclose(res.vector, [0.63707106, 1.0980951, 1.77332591], rtol=1e-7)
    assert res.selected[-1] == 0 and np.all((res.selected >= 0) & (res.selected <= 1))
    calls[0] = 0
    make_aggregator("caf", 4, {"variant": "byzfl", "max_iter": 50})(X_FAR)
    assert calls[0] == 50  # ByzFL's scaling: stopped by max_iter


@pytest.mark.parametrize("key", [("caf", "BYZFL", 1), ("caf", "X_LINE", 1), ("caf", "X_LINE", 2)], ids=str)
def test_caf_default_equals_byzfl_while_a_weighted_row_sets_the_scale(key):
    _, name, f = key
    np.testing.assert_allclose(make_aggregator("caf", f, {})(INPUTS[name]), BYZFL_RULES[key], rtol=1e-12)


def test_caf_f0_and_coincident_rows_give_the_mean():
    """ByzFL returns None in both cases (f = 0: its loop never runs; equal rows: 0/0)."""
    np.testing.assert_allclose(make_aggregator("caf", 0, {})(X_OUT), X_OUT.mean(axis=0), rtol=1e-15)
    np.testing.assert_array_equal(make_aggregator("caf", 1, {})(np.ones((3, 2))), [1.0, 1.0])


# --------------------------------------------------------------------------------------
# MDA and SMEA: exact searches, bounded
# --------------------------------------------------------------------------------------


def brute_force(X: np.ndarray, f: int, spread) -> tuple[int, ...]:
    """The first subset of n - f rows (itertools order) with the smallest ``spread``: ByzFL's loop."""
    best, chosen = np.inf, None
    for S in itertools.combinations(range(len(X)), len(X) - f):
        value = spread(X[list(S)])
        if value < best:
            best, chosen = value, S
    assert chosen is not None
    return chosen


def diameter(R):
    return max((float(((a - b) ** 2).sum()) for a, b in itertools.combinations(R, 2)), default=0.0)


def top_eigenvalue(R):
    return float(np.linalg.eigvalsh(np.atleast_2d(np.cov(R.T, bias=True)))[-1])


def test_mda_search_equals_the_enumeration_with_its_tie_breaking():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(3, 10))
        f = int(rng.integers(1, (n + 1) // 2))
        X = rng.integers(0, 3, size=(n, int(rng.integers(1, 4)))).astype(float)  # many exact ties
        got = np.flatnonzero(make_aggregator("mda", f, {}).aggregate(X).selected)
        assert tuple(got) == brute_force(X, f, diameter), (X, f)


def test_mda_at_100_clients_and_its_bound():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(100, 64))
    X[[3, 17, 40, 41, 55, 60, 71, 80, 90, 99]] += 6.0  # ten rows far away
    res = make_aggregator("mda", 10, {}).aggregate(X)
    honest = np.setdiff1d(np.arange(100), [3, 17, 40, 41, 55, 60, 71, 80, 90, 99])
    np.testing.assert_array_equal(np.flatnonzero(res.selected), honest)
    np.testing.assert_allclose(res.vector, X[honest].mean(axis=0), rtol=1e-12)
    assert mda_search_bound(100, 17) <= 1_000_000 < mda_search_bound(100, 18)
    assert make_aggregator("mda", 17, {}).check(100) is None
    assert make_aggregator("mda", 18, {}).check(100) == (
        "mda's exact search for f=18 among n=100 clients may visit 1,236,785 nodes, more than "
        "mda.max_nodes=1,000,000: use a smaller f or raise mda.max_nodes"
    )
    assert make_aggregator("mda", 18, {"max_nodes": 2_000_000}).check(100) is None
    assert make_aggregator("mda", 2, {}).check(4) == "mda needs n > 2f, got n=4, f=2"
    D2 = np.array([[0.0, 1, 1], [1, 0, 1], [1, 1, 0]])
    assert min_diameter_subset(D2, 1).tolist() == [0, 1]


def test_smea_equals_the_enumeration_with_the_exact_eigenvalue_and_its_bound():
    rng = np.random.default_rng(2)
    for _ in range(60):
        n = int(rng.integers(3, 9))
        f = int(rng.integers(1, (n + 1) // 2))
        X = rng.normal(size=(n, int(rng.integers(1, 5))))
        got = np.flatnonzero(make_aggregator("smea", f, {}).aggregate(X).selected)
        assert tuple(got) == brute_force(X, f, top_eigenvalue), (X, f)
    assert make_aggregator("smea", 2, {}).check(100) is None  # C(100, 2) = 4,950
    assert make_aggregator("smea", 3, {}).check(100) == (
        "smea examines every subset of n - f clients: C(100, 3) = 161,700 is more than "
        "smea.max_subsets=100,000; use a smaller f or raise smea.max_subsets"
    )


def test_subset_rules_ties_go_to_the_first_subset():
    for rule in ("mda", "smea"):
        assert make_aggregator(rule, 1, {}).aggregate(X_LINE[:4]).selected.tolist() == [1, 1, 1, 0]
        assert make_aggregator(rule, 1, {}).aggregate(X_LINE[::-1][:4]).selected.tolist() == [1, 1, 1, 0]


# --------------------------------------------------------------------------------------
# MoNNA: the trusted vector
# --------------------------------------------------------------------------------------


def test_monna_trusts_the_server_reference_by_default():
    a = make_aggregator("monna", 2, {})
    assert a.needs_reference and not make_aggregator("monna", 2, {"idx": 0}).needs_reference
    with pytest.raises(ValueError, match="needs the server's reference"):
        a(X_OUT)
    # squared distances to the reference: 0.13, 0.10, 0.30, 0.06, 0.11, 282.25
    res = a.aggregate(X_OUT, reference=np.array([0.0, -1.0, 0.5, 2.0]))
    np.testing.assert_array_equal(res.selected, [1, 1, 0, 1, 1, 0])
    np.testing.assert_allclose(res.vector, X_OUT[[0, 1, 3, 4]].mean(axis=0), rtol=1e-15)


def test_monna_idx_names_a_client_when_rows_are_left_out():
    X = X_RAND.copy()
    X[1, 2] = np.nan
    res = make_aggregator("monna", 2, {"idx": 3}).aggregate(X)  # client 3 is row 2 of the finite rows
    finite = np.delete(X_RAND, 1, axis=0)
    direct = make_aggregator("monna", 1, {"idx": 2}).aggregate(finite)
    np.testing.assert_array_equal(res.vector, direct.vector)
    np.testing.assert_array_equal(np.delete(res.selected, 1), direct.selected)
    assert res.excluded.tolist() == [False, True, False, False, False, False, False]
    X[3, 0] = np.inf  # the trusted client's own row: no update
    res = make_aggregator("monna", 2, {"idx": 3}).aggregate(X)
    assert not res.vector.any() and not res.selected.any()
    rule = make_aggregator("monna", 1, {"idx": 3})  # a sampled cohort: clients 0, 3, 5, 6
    part = rule.aggregate_part(rule, X_RAND[[0, 3, 5, 6]], np.array([0, 3, 5, 6]), {}, None, None)
    np.testing.assert_array_equal(part.vector, make_aggregator("monna", 1, {"idx": 1})(X_RAND[[0, 3, 5, 6]]))
    absent = rule.aggregate_part(rule, X_RAND[[0, 5, 6]], np.array([0, 5, 6]), {}, None, None)
    assert not absent.vector.any() and not absent.selected.any()
    assert make_aggregator("monna", 1, {"idx": 7}).check(7) == "monna.idx=7 names no client: there are n=7"


def test_monna_ties_go_to_the_lower_index():
    # distances from row 2 of X_LINE: 2, 1, 0, 1, 2: rows 0 and 4 tie for the fourth place
    res = make_aggregator("monna", 1, {"idx": 2}).aggregate(X_LINE)
    assert res.selected.tolist() == [1, 1, 1, 1, 0]


# --------------------------------------------------------------------------------------
# every new rule at large d, float32 in, float32 out, no d x d matrix
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["mda", "smea", "caf", "monna", "meamed"])
def test_large_d_float32_matches_float64(rule):
    rng = np.random.default_rng(3)
    X = rng.normal(size=(12, 300_000)).astype(np.float32) + rng.normal(size=(12, 1)).astype(np.float32)
    X[:2] += 3
    params = {"idx": 5} if rule == "monna" else {}
    out32 = make_aggregator(rule, 2, params)(X)
    out64 = make_aggregator(rule, 2, params)(X.astype(np.float64))
    assert out32.dtype == np.float32 and out32.shape == (300_000,)
    np.testing.assert_allclose(out32, out64, rtol=0, atol=1e-5)


def test_arc_float32_and_its_check():
    Y, owner = PRE_AGGREGATORS["arc"](1).transform(X_RAND.astype(np.float32), None)
    assert Y.dtype == np.float32 and owner.tolist() == list(range(7))
    assert PRE_AGGREGATORS["arc"](8).check(7) == "arc needs f <= n, got n=7, f=8"
    out = make_aggregator("mean", 1, {}, pre=["arc"])(X_RAND)  # ARC in front of a rule
    np.testing.assert_allclose(out, np.array(BYZFL_ARC["arc", "X_RAND", 1]).reshape(7, 5).mean(axis=0), rtol=1e-14)


# --------------------------------------------------------------------------------------
# the optimal attacks against ByzFL
# --------------------------------------------------------------------------------------

#: case -> (honest rows, attackers b, fedring's defence (rule, params, pre)) as given to ByzFL:
#: docstring: TrMean(1) after [NNM(1), Clipping()]; default: Average() after [Clipping()] (ByzFL's
#: defaults); median: Median(); mda: MDA(2); meamed_arc: Meamed(2) after [ARC(2)]; monna:
#: MoNNA(2, idx=0); trmean_nnm: TrMean(2) after [NNM(2)]
ATTACK_CASES = {
    "docstring": (BYZFL, 1, ("trimmed_mean", {}, ["nnm", "clipping"])),
    "default": (X_RAND[:6], 2, ("mean", {}, ["clipping"])),
    "median": (X_RAND[:6], 2, ("median", {}, [])),
    "mda": (X_RAND[:6], 2, ("mda", {}, [])),
    "meamed_arc": (X_RAND[:6], 2, ("meamed", {}, ["arc"])),
    "monna": (X_RAND[:6], 2, ("monna", {"idx": 0}, [])),
    "trmean_nnm": (X_OUT[:5], 2, ("trimmed_mean", {}, ["nnm"])),
}
#: ByzFL's tau wanders along a plateau of the objective (decided by rounding): fedring keeps its start
PLATEAU = {("optimal_ipm", "default"): 10.0, ("optimal_ipm", "meamed_arc"): 10.0}


def attack_output(attack: str, case: str, dtype=np.float64) -> tuple[np.ndarray, object]:
    honest, b, (rule, params, pre) = ATTACK_CASES[case]
    defence = make_aggregator(rule, b, params, pre=pre)
    n = honest.shape[0] + b
    ctx = AttackContext(np.random.default_rng(0), n=n, f=b, lr=0.1, round=0, aggregator=defence)
    out = make_attack(attack, {})(np.zeros((b, honest.shape[1]), dtype), honest.astype(dtype), ctx)
    assert out.shape == (b, honest.shape[1]) and out.dtype == dtype and np.all(out == out[0])
    return out[0], defence


@pytest.mark.parametrize("key", [k for k in BYZFL_ATTACKS if k not in PLATEAU], ids=str)
def test_optimal_attack_matches_byzfl(key):
    got, _ = attack_output(*key)
    np.testing.assert_array_equal(got, BYZFL_ATTACKS[key])


@pytest.mark.parametrize("key", list(PLATEAU), ids=str)
def test_optimal_attack_on_a_plateau_keeps_its_first_tau_with_the_same_effect(key):
    attack, case = key
    got, defence = attack_output(attack, case)
    honest, b, _ = ATTACK_CASES[case]
    mu = honest.mean(axis=0)
    np.testing.assert_allclose(got, -PLATEAU[key] * mu, rtol=1e-15)

    def defended(row):
        return defence(np.vstack([honest, np.broadcast_to(row, (b, honest.shape[1]))]))

    # ByzFL's tau (22.8 and 10.45...) gives the defence the same output, to rounding
    np.testing.assert_allclose(defended(got), defended(np.array(BYZFL_ATTACKS[key])), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("attack", ["optimal_alie", "optimal_ipm"])
def test_optimal_attacks_are_blockwise_and_dtype_independent(attack, monkeypatch):
    """As every blockwise attack (tests/test_attacks_blockwise.py): float32 rows as sent, or float64
    copies of them, and any column block give the float64 result, bit for bit."""
    from fedring.attacks import base as attack_base

    rng = np.random.default_rng(4)
    honest = (rng.standard_normal((9, 23)) * np.logspace(-3, 3, 23)).astype(np.float32)
    byz = rng.standard_normal((3, 23)).astype(np.float32)
    defence = make_aggregator("trimmed_mean", 3, {}, pre=["clipping"], sections={"clipping": {"c": 50.0}})
    ctx = AttackContext(np.random.default_rng(0), n=12, f=3, lr=0.1, round=0, aggregator=defence)
    whole = make_attack(attack, {})(byz.astype(np.float64), honest.astype(np.float64), ctx)
    for block in (2, 5, 64):
        monkeypatch.setattr(attack_base, "BLOCK", block)
        assert make_attack(attack, {})(byz.astype(np.float64), honest, ctx).tobytes() == whole.tobytes()
        out = make_attack(attack, {})(byz, honest, ctx)
        assert out.dtype == np.float32 and out.tobytes() == whole.astype(np.float32).tobytes()


def test_byzfl_line_search_only_steps_upwards_after_the_expansion():
    seen: list[float] = []

    def objective(t):
        seen.append(t)
        return -abs(t - 7.0)

    assert byzfl_line_search(objective, evals=5) == 10.0
    assert seen == [0.0, 10.0, 30.0, 26.0, 22.8]  # 10 + 20 * 0.8, 10 + 16 * 0.8
    # a negative delta searches downwards: 0, -1, -3, -7 (a tie is no gain), then -3 - 3.2 ...
    assert byzfl_line_search(lambda t: -abs(t + 5.0), delta=-1.0, evals=8) == pytest.approx(-6.2, rel=1e-15)


def test_optimal_attacks_settings_and_checks():
    for name in ("optimal_alie", "optimal_ipm"):
        for params, key in [
            ({"delta": 0}, "attack.delta"),
            ({"ratio": 0.5}, "attack.ratio"),
            ({"ratio": 1.0}, "attack.ratio"),
            ({"evals": 0}, "attack.evals"),
            ({"start": "x"}, "attack.start"),
        ]:
            with pytest.raises(ConfigError) as err:
                make_attack(name, params)
            assert err.value.key == key
    assert make_attack("optimal_alie", {}).check(5, 3) is None
    error = make_attack("optimal_alie", {}).check(5, 4)  # returned, not raised (ModelAttack.require raises)
    assert isinstance(error, ConfigError) and error.key == "byzantine"
    assert str(error) == (
        "byzantine: attack optimal_alie needs at least 2 honest client(s), got n=5 clients of which b=4 Byzantine"
    )
    assert make_attack("optimal_ipm", {}).check(5, 4) is None
    with pytest.raises(ConfigError, match="at least 2 honest"):
        make_attack("optimal_alie", {})(
            np.zeros((1, 3)), BYZFL[:1], AttackContext(np.random.default_rng(0), 2, 1, 0.1, 0, None)
        )
    ctx = AttackContext(np.random.default_rng(0), n=4, f=1, lr=0.1, round=0, aggregator=None)
    with pytest.raises(ConfigError, match="needs the defence's aggregation rule"):
        make_attack("optimal_ipm", {})(np.zeros((1, 3)), BYZFL, ctx)
