#!/usr/bin/env python3
"""Generate the toy fictional-world knowledge base and QA sets in data/toy/ (standard library only).

The world is invented from syllables, so no pretrained model can know it: countries, mountains,
rivers, towns, people, companies, works (novels, films, paintings, albums) and events, each with a
few attributes, many of which link to other entities (a person's birthplace is a town, a company's
founder a person, ...), so two-hop questions exist. About a fifth of the people, companies and towns
are near-namesakes of an earlier entity (one vowel changed) sharing some of its values: retrieval
distractors. Each entity gets one passage, or two splitting its facts (Search-R1 corpus format).

Questions (FlashRAG format): ~50% single-hop (one fact), ~30% bridge (a fact of an entity named only
through a fact of another, HotpotQA style), ~20% comparison (which is older / larger / taller, or
yes-no "both" / "same" questions). Test questions name no entity that a train question names.
Each row's metadata records its reasoning chain (what toy/oracle.py acts out):

    {"type": "single" | "bridge" | "comparison",
     "supporting_ids": [passage id, ...],           # the passages stating the facts it needs
     "chain": [                                     # one hop per fact, in order
         {"search": "Velmora Quint",                # the entity to look up (the passage title)
          "fact": "She was born in 1911.",          # the sentence as it appears in the passage
          "note": "Velmora Quint was born in 1911.",  # the same fact with its subject named
          "passage_id": "1234",                     # the passage that states it
          "answer": "1911",                         # the hop's answer (a bridge's first hop: the
                                                    #   entity the second hop looks up)
          "relation": "birth_year"}, ...],          # which attribute the fact states (SPEC below)
     "compare": "smaller" | "larger" | "same"}      # comparisons only: the gold answer is the hop
                                                    #   entity with the smaller / larger number, or
                                                    #   yes/no for whether the two answers are equal

The last hop's answer is the gold answer of single-hop and bridge questions.

    python toy/make_toy.py --out data/toy --seed 0 --passages 3000 --train 2000 --test 200
    python toy/make_toy.py --out data/toy_seed1 --seed 1   # a second world, no name shared with seed 0's
"""
import argparse
import json
import os
import random

# ---------------------------------------------------------------------------------------------
# 1. Vocabulary: syllables for names, and the fixed words the world is described with
# ---------------------------------------------------------------------------------------------
SYLLABLES = ("ka ve lo ri tha mo su de na vi ro ze pa lu mi dra kor vel tan sen bra quo ly ith ar "
             "en os ul ma gal fen tor hes bel cas dun el far gor jan kel lin mar nor per rus sal "
             "tem var wen yor zan").split()
GIVEN_ENDS = ["a", "en", "is", "o", "ra", "eth", "in", "ia", "us", "el"]
SURNAME_ENDS = ["", "ck", "n", "ry", "ston", "well", "mar", "ez", "ov", "and", "ett"]
TOWN_ENDS = ["sk", "holm", "by", "ford", "mere", "stad", "wick", "ova", "dor", "heim", "ac"]
COUNTRY_ENDS = ["ia", "ovia", "and", "esh", "ara", "onia", "avar"]
LANGUAGE_ENDS = ["ish", "ic", "an", "ese", "i"]
COMPANY_ENDS = ["Mills", "Works", "Group", "& Sons", "Company", "Holdings", "Brothers",
                "Industries", "Union", "Partners", "Trading"]
INDUSTRIES = ["textile", "steel", "publishing", "shipbuilding", "brewing", "pharmaceutical",
              "railway", "glassmaking", "insurance", "chemical", "mining", "toy"]
WORK_KINDS = {  # kind: (past participle, question verb, release verb, maker noun, genres)
    "novel": ("written", "wrote", "published", "author", ["mystery", "satire", "romance", "science fiction"]),
    "film": ("directed", "directed", "released", "director", ["comedy", "thriller", "western", "documentary"]),
    "painting": ("created", "painted", "completed", "painter", ["landscape", "portrait", "still life", "seascape"]),
    "album": ("recorded", "recorded", "released", "recording artist", ["jazz", "folk", "rock", "blues"]),
}
CREATIVE = {"novelist": "novel", "film director": "film", "painter": "painting", "musician": "album"}
EARLIEST = {"film director": 1870, "musician": 1885}  # birth years: no films or albums before ~1890
OTHER_JOBS = ["engineer", "chemist", "architect", "physician", "banker", "merchant", "journalist"]
EVENT_KINDS = ["Festival", "Exhibition", "Tournament", "Congress", "Fair", "Regatta", "Conference"]
TITLE_WORDS = ["Lanterns", "Ashes", "Letters", "Songs", "Winter", "Harbour", "Mirrors", "Bells",
               "Shadows", "Gardens", "Voices", "Salt", "Embers", "Crowns", "Tides", "Orchards"]
TITLE_PATTERNS = ["{w} of {r}", "The {r} {w}", "{w} for {r}", "After {r}", "{r}"]

# Fact-free sentences that pad passages to 40+ words, " | "-separated ({He}/{his}/... for people).
FILLERS = {k: v.split(" | ") for k, v in {
    "person": "Colleagues remembered {him} as patient, stubborn and quick to laugh. | {He} kept detailed "
              "notebooks all {his} life. | In later years {he} rarely gave interviews to the press. | {He} "
              "was fond of long walks, chess and old maps. | {His} early years were marked by frequent "
              "travel. | {He} spoke three languages fluently and read widely.",
    "company": "The company began as a small workshop with a handful of employees. | Its logo has changed "
               "several times over the decades. | The firm survived two serious financial crises. | It is "
               "known locally for sponsoring a youth football club. | Many of its early records were lost "
               "in a warehouse fire. | The firm has long been praised for its apprenticeship programme.",
    "town": "The town is known for its stone bridges and a busy autumn market. | Its old quarter contains "
            "narrow lanes and a covered square. | Many residents commute to nearby villages for work. | A "
            "small museum in the town displays local crafts and tools. | Winters there are long and usually "
            "snowy. | A weekly newspaper has been printed there for generations.",
    "river": "Its waters are popular with anglers in the summer months. | Several old mills once stood "
             "along its banks. | The river freezes over in particularly cold winters. | Ferries cross it at "
             "a few points along its course. | Its valley is known for orchards and small vineyards. | "
             "Herons and kingfishers nest in the reeds along its banks.",
    "mountain": "Its upper slopes are covered in snow for most of the year. | Climbers usually attempt the "
                "summit in late summer. | A small stone hut near the summit shelters hikers. | The mountain "
                "is a popular subject for local painters. | Its lower forests are home to deer and wild "
                "boar. | On clear days the summit can be seen from far away.",
    "country": "The country is divided into several provinces. | Its flag features three horizontal stripes "
               "of different colours. | Agriculture remains an important part of its economy. | The "
               "country has a long tradition of choral music. | Its parliament meets twice a year, in "
               "spring and autumn. | Rail lines connect most of its larger towns.",
    "work": "Critics were divided when it first appeared. | It has since been the subject of several "
            "academic studies. | The work gained a devoted following over the years. | A restored edition "
            "appeared several decades later. | It is often cited as an influence by younger artists. | Some "
            "contemporaries considered it too unusual to succeed.",
    "event": "Thousands of visitors attended over several days. | Local newspapers covered it in "
             "considerable detail. | It was remembered for its unusually warm weather. | Several "
             "participants later wrote accounts of it. | A commemorative plaque marks the occasion. | "
             "Tickets sold out weeks before the opening day.",
}.items()}

# ---------------------------------------------------------------------------------------------
# 2. Facts: per entity type, (attribute, passage sentence, single-hop question, bridge phrase).
#    {S} = subject at sentence start, {v} = value, {X} = noun phrase naming the subject. A bridge
#    phrase describes the linked entity through this fact (e.g. "the founder of Drakken Mills").
# ---------------------------------------------------------------------------------------------
SPEC = {
    "country": [
        ("capital", "{S} has its capital in {v}.", "What is the capital of {X}?", "the capital of {X}"),
        ("language", "{S} has {v} as its official language.", "What is the official language of {X}?", None),
        ("independence", "{S} became independent in {v}.", "In what year did {X} become independent?", None)],
    "mountain": [
        ("country", "{S} is a mountain in {v}.", "In which country is {X}?", "the country in which {X} stands"),
        ("height", "{S} rises to {v} above sea level.", "How tall is {X}?", None),
        ("climber", "{S} was first climbed by {v}.", "Who first climbed {X}?", "the first person to climb {X}"),
        ("climb_year", "{S} was first climbed in {v}.", "In what year was {X} first climbed?", None)],
    "river": [
        ("country", "{S} flows through {v}.", "Which country does {X} flow through?", "the country that {X} flows through"),
        ("length", "{S} is {v} long.", "How long is {X}?", None),
        ("source", "{S} rises on the slopes of {v}.", "On which mountain does {X} rise?", "the mountain on which {X} rises")],
    "town": [
        ("country", "{S} is a town in {v}.", "In which country is {X}?", "the country where {X} is located"),
        ("river", "{S} lies on the {v}.", "On which river does {X} lie?", "the river on which {X} lies"),
        ("population", "{S} has a population of {v}.", "What is the population of {X}?", None),
        ("founded", "{S} was founded in {v}.", "In what year was {X} founded?", None)],
    "person": [
        ("birth_year", "{S} was born in {v}.", "In what year was {X} born?", None),
        ("birthplace", "{S} was born in the town of {v}.", "In which town was {X} born?", "the town where {X} was born"),
        ("occupation", "{S} worked as {a} {v}.", "What was the occupation of {X}?", None),
        ("employer", "{S} spent most of {his} career at {v}.", "Which company did {X} work for?", "the company that {X} worked for"),
        ("spouse", "{S} was married to {v}.", "Who was {X} married to?", "the spouse of {X}"),
        ("notable_work", "{S} is best known for the {wkind} {v}.", "What is the best-known {wkind} by {X}?", "the best-known {wkind} by {X}")],
    "company": [
        ("founded", "{S} was founded in {v}.", "In what year was {X} founded?", None),
        ("founder", "{S} was established by {v}.", "Who founded {X}?", "the founder of {X}"),
        ("hq", "{S} is headquartered in {v}.", "In which town is {X} headquartered?", "the town where {X} is headquartered"),
        ("industry", "{S} operates in the {v} industry.", "Which industry does {X} operate in?", None)],
    "work": [  # the creator fact always opens the first passage, so {S} is then the title
        ("creator", "{S} is a {kind} {made} by {v}.", "Who {verb} {X}?", "the {maker} of {X}"),
        ("year", "{S} was {released} in {v}.", "In what year was {X} {released}?", None),
        ("genre", "{S} belongs to the {v} genre.", "What genre does {X} belong to?", None)],
    "event": [
        ("year", "{S} took place in {v}.", "In what year did {X} take place?", None),
        ("location", "{S} was held in {v}.", "In which town was {X} held?", "the town where {X} was held"),
        ("organizer", "{S} was organised by {v}.", "Who organised {X}?", "the organiser of {X}")],
}
# Bridge questions whose wording gives the answer away ("the painter of ..." is a painter).
TRIVIAL = {("work", "creator", "occupation"), ("mountain", "climber", "occupation")}
LINKS = {"capital", "country", "climber", "source", "river", "birthplace", "employer", "spouse",
         "notable_work", "founder", "hq", "creator", "location", "organizer"}


# ---------------------------------------------------------------------------------------------
# 3. The world: entities with unique invented names and linked attributes
# ---------------------------------------------------------------------------------------------
class World:
    def __init__(self, rng, reserved=()):
        """`reserved`: lower-cased names no entity of this world may take (another world's)."""
        self.rng, self.ents, self.used = rng, [], set(reserved)

    def root(self, n=2):
        return "".join(self.rng.choice(SYLLABLES) for _ in range(n)).capitalize()

    def unique(self, make, like=None):
        """A name from make() that no entity has yet; a one-vowel variant of `like` if possible.
        A river's or mountain's short form ("Kessa" for "Mount Kessa") is reserved too."""
        for attempt in range(500):
            name = (self.variant(like) if like and attempt < 30 else None) or make()
            keys = {name.lower(), name.lower().replace(" river", "").replace("mount ", "")}
            if not keys & self.used:
                self.used |= keys
                return name
        raise RuntimeError("name space exhausted")

    def variant(self, name):
        first, _, rest = name.partition(" ")
        spots = [i for i, c in enumerate(first) if c.lower() in "aeiou"]
        if not spots:  # no vowel to change ("Ystryn"): the caller makes a fresh name
            return None
        i = self.rng.choice(spots)
        new = self.rng.choice([v for v in "aeiou" if v != first[i].lower()])
        first = first[:i] + (new.upper() if first[i].isupper() else new) + first[i + 1:]
        return " ".join(x for x in (first, rest) if x)

    def add(self, type_, name, **a):
        e = {"i": len(self.ents), "type": type_, "name": name, "a": a}
        self.ents.append(e)
        return e

    def of(self, type_):
        return [e for e in self.ents if e["type"] == type_]


def build_world(rng, n_passages, reserved=()):
    w = World(rng, reserved)
    n = lambda k: max(4, round(k * n_passages / 3000))  # entity counts scale with --passages
    R, pick = rng.randint, rng.choice
    for _ in range(n(14)):
        w.add("country", w.unique(lambda: w.root() + pick(COUNTRY_ENDS)),
              language=w.unique(lambda: w.root() + pick(LANGUAGE_ENDS)), independence=R(1400, 1960))
    countries = w.of("country")
    for k in range(n(60)):
        w.add("mountain", w.unique(lambda: "Mount " + w.root()), country=countries[k % len(countries)]["i"],
              height=R(900, 6800))
    for k in range(n(70)):
        c = countries[k % len(countries)]["i"]
        source = pick([m for m in w.of("mountain") if m["a"]["country"] == c])
        w.add("river", w.unique(lambda: w.root() + " River"), country=c, length=R(40, 2400), source=source["i"])
    for k in range(n(260)):
        like = pick(w.of("town")) if k > 30 and rng.random() < 0.2 else None  # near-namesake
        c = like["a"]["country"] if like else countries[k % len(countries)]["i"]
        river = like["a"]["river"] if like else pick([r for r in w.of("river") if r["a"]["country"] == c])["i"]
        w.add("town", w.unique(lambda: w.root(pick([1, 2])) + pick(TOWN_ENDS), like and like["name"]),
              country=c, river=river, population=R(800, 250000), founded=R(800, 1750))
    towns = w.of("town")
    for c in countries:
        c["a"]["capital"] = pick([t for t in towns if t["a"]["country"] == c["i"]])["i"]
    jobs = list(CREATIVE) * 5 + OTHER_JOBS * 3 + ["mountaineer"] * 2
    for k in range(n(900)):
        like = pick(w.of("person")) if k > 50 and rng.random() < 0.2 else None
        make = lambda: f"{w.root() + pick(GIVEN_ENDS)} {w.root(pick([1, 2])) + pick(SURNAME_ENDS)}"
        job = like["a"]["occupation"] if like else pick(jobs)
        p = w.add("person", w.unique(make, like and like["name"]),
                  birth_year=like["a"]["birth_year"] + R(-3, 3) if like else R(EARLIEST.get(job, 1800), 1985),
                  birthplace=like["a"]["birthplace"] if like else pick(towns)["i"], occupation=job)
        p["he"] = pick(["he", "she"])
    people = w.of("person")
    adults = [p for p in people if p["a"]["birth_year"] <= 1975 and p["a"]["occupation"] != "mountaineer"]
    for k in range(n(240)):
        like = pick(w.of("company")) if k > 20 and rng.random() < 0.2 else None
        f = pick(adults)
        w.add("company", w.unique(lambda: f"{w.root()} {pick(COMPANY_ENDS)}", like and like["name"]),
              founded=min(f["a"]["birth_year"] + R(22, 50), 2020), founder=f["i"],
              hq=like["a"]["hq"] if like else pick(towns)["i"],
              industry=like["a"]["industry"] if like else pick(INDUSTRIES))
    companies = w.of("company")
    for p in people:  # employers: a company that existed while the person was of working age
        if p["a"]["occupation"] in OTHER_JOBS:
            ok = [c for c in companies if c["a"]["founded"] <= p["a"]["birth_year"] + 45]
            if ok:
                p["a"]["employer"] = pick(ok)["i"]
    order = sorted(people, key=lambda p: p["a"]["birth_year"] + 8 * rng.random())
    for a, b in zip(order[0::2], order[1::2]):  # spouses: neighbours in (jittered) birth order
        if rng.random() < 0.6:
            a["a"]["spouse"], b["a"]["spouse"] = b["i"], a["i"]
    creators = [p for p in people if p["a"]["occupation"] in CREATIVE]
    for k in range(max(n(480), len(creators))):
        p = creators[k] if k < len(creators) else pick(creators)
        kind = CREATIVE[p["a"]["occupation"]]
        make = lambda: pick(TITLE_PATTERNS).format(w=pick(TITLE_WORDS), r=w.root())
        wk = w.add("work", w.unique(make), creator=p["i"], year=min(p["a"]["birth_year"] + R(20, 60), 2023),
                   genre=pick(WORK_KINDS[kind][4]))
        wk["kind"] = kind
        p["a"].setdefault("notable_work", wk["i"])
    climbers = [p for p in people if p["a"]["occupation"] == "mountaineer"] or people
    for m in w.of("mountain"):
        c = pick(climbers)
        m["a"].update(climber=c["i"], climb_year=min(c["a"]["birth_year"] + R(20, 40), 2020))
    for _ in range(n(160)):
        org = pick(adults)
        w.add("event", w.unique(lambda: f"{w.root()} {pick(EVENT_KINDS)}"),
              year=min(org["a"]["birth_year"] + R(25, 60), 2022), location=pick(towns)["i"], organizer=org["i"])
    return w


# ---------------------------------------------------------------------------------------------
# 4. Wording helpers: how an entity is named, and how a value is written and accepted
# ---------------------------------------------------------------------------------------------
def ref(e):
    """Noun phrase naming e inside a sentence."""
    if e["type"] in ("river", "event"):
        return "the " + e["name"]
    return f"the {e['kind']} {e['name']}" if e["type"] == "work" else e["name"]


def subject(e, first):
    """Sentence-initial subject: the name in a passage's first sentence, else a pronoun."""
    if first:
        return "The " + e["name"] if e["type"] in ("river", "event") else e["name"]
    if e["type"] == "person":
        return e["he"].capitalize()
    return "The " + (e["kind"] if e["type"] == "work" else e["type"])


def fields(w, e):
    """Template words that depend on the entity (pronouns, work kind verbs)."""
    f = {}
    if e["type"] == "person":
        he = e["he"]
        f = {"he": he, "him": "him" if he == "he" else "her", "his": "his" if he == "he" else "her"}
        f.update({k.capitalize(): v.capitalize() for k, v in f.items()})
        f["a"] = "an" if e["a"]["occupation"][0] in "aeiou" else "a"
        if "notable_work" in e["a"]:
            f["wkind"] = w.ents[e["a"]["notable_work"]]["kind"]
    if e["type"] == "work":
        made, verb, released, maker, _ = WORK_KINDS[e["kind"]]
        f = {"kind": e["kind"], "made": made, "verb": verb, "released": released, "maker": maker}
    return f


def aliases(e):
    """Accepted names of an entity: the full name, and without "Mount"/"River"."""
    return list(dict.fromkeys([e["name"], e["name"].replace(" River", "").replace("Mount ", "")]))


def answers(w, e, attr):
    """Accepted answers for e's attribute; the first is the form the passage uses."""
    v = e["a"][attr]
    if attr in LINKS:
        out = aliases(w.ents[v])
    elif attr == "population":
        out = [f"{v:,}", str(v)]
    elif attr == "length":
        out = [f"{v:,} kilometres", f"{v:,} km", f"{v} km", f"{v:,}", str(v)]
    elif attr == "height":
        out = [f"{v:,} metres", f"{v:,} m", f"{v} metres", f"{v:,}", str(v)]
    else:
        out = [str(v)]
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------------------------
# 5. Passages: one or two per entity (facts split), padded with fact-free filler, shuffled
# ---------------------------------------------------------------------------------------------
def make_passages(rng, w, n_passages):
    facts = [[spec for spec in SPEC[e["type"]] if spec[0] in e["a"]] for e in w.ents]
    n_split = max(0, min(n_passages - len(w.ents), len(w.ents)))
    split = set(rng.sample(range(len(w.ents)), n_split))
    pieces = []  # (entity, facts in this passage)
    for e in w.ents:
        fs = facts[e["i"]]
        if e["i"] in split and len(fs) > 1:
            k = rng.randint(1, len(fs) - 1)
            pieces += [(e, fs[:k]), (e, fs[k:])]
        else:
            pieces.append((e, fs))
    rng.shuffle(pieces)
    corpus, where, said = [], {}, {}  # [(entity index, attribute)] = passage id / sentence stating it
    for pid, (e, fs) in enumerate(pieces):
        f = fields(w, e)
        sents = []
        for j, (attr, say, _, _) in enumerate(fs):
            v = answers(w, e, attr)[0]
            sents.append(say.format(S=subject(e, j == 0), v=v, **f))
            where[(e["i"], attr)], said[(e["i"], attr)] = pid, sents[-1]
        pad = rng.sample(FILLERS[e["type"]], len(FILLERS[e["type"]]))
        target = rng.randint(42, 65)
        while len(" ".join(sents).split()) < target and pad:
            sents.insert(rng.randint(1, len(sents)), pad.pop().format(**f))
        text = " ".join(sents)
        assert 40 <= len(text.split()) <= 100, text
        corpus.append({"id": str(pid), "contents": f'"{e["name"]}"\n{text}'})
    return corpus, where, said


def chain_step(w, where, said, e, attr):
    """One step of a reasoning chain: look up entity e, read the fact stating its attribute."""
    f = fields(w, e)
    say = next(spec[1] for spec in SPEC[e["type"]] if spec[0] == attr)
    value = answers(w, e, attr)[0]
    return {"search": e["name"], "fact": said[(e["i"], attr)], "note": say.format(S=subject(e, True), v=value, **f),
            "passage_id": str(where[(e["i"], attr)]), "answer": value, "relation": attr}


# ---------------------------------------------------------------------------------------------
# 6. Candidate questions. Each: group (for balanced sampling), question, answers, supporting
#    passages, the entities it names, checks = (passage id, string that passage must state), and
#    its reasoning chain (one `chain_step` per fact; comparisons also say how the answer follows).
# ---------------------------------------------------------------------------------------------
def single_hop(w, where, said):
    for e in w.ents:
        for attr, _, ask, _ in SPEC[e["type"]]:
            if attr in e["a"]:
                ans, pid = answers(w, e, attr), where[(e["i"], attr)]
                yield dict(type="single", group=(e["type"], attr), names=[e["i"]], answers=ans,
                           question=ask.format(X=ref(e), **fields(w, e)), sup=[pid], checks=[(pid, ans[0])],
                           chain=[chain_step(w, where, said, e, attr)])


def bridge(w, where, said):
    for x in w.ents:
        for attr1, _, _, hop in SPEC[x["type"]]:
            if hop is None or attr1 not in x["a"]:
                continue
            y = w.ents[x["a"][attr1]]
            phrase = hop.format(X=ref(x), **fields(w, x))
            for attr2, _, ask, _ in SPEC[y["type"]]:
                if attr2 not in y["a"] or (attr2 in LINKS and y["a"][attr2] == x["i"]) \
                        or (x["type"], attr1, attr2) in TRIVIAL:
                    continue  # skip questions answered by the named entity itself or by the phrase
                ans, p1, p2 = answers(w, y, attr2), where[(x["i"], attr1)], where[(y["i"], attr2)]
                yield dict(type="bridge", group=(x["type"], attr1, attr2), names=[x["i"]], answers=ans,
                           question=ask.format(X=phrase, **fields(w, y)), sup=[p1, p2],
                           checks=[(p1, y["name"]), (p2, ans[0])],
                           chain=[chain_step(w, where, said, x, attr1), chain_step(w, where, said, y, attr2)])


WHICH = [  # (type, attribute, question, pick the larger value?)
    ("person", "birth_year", "Who was born first, {A} or {B}?", False),
    ("company", "founded", "Which company was founded earlier, {A} or {B}?", False),
    ("town", "founded", "Which town was founded earlier, {A} or {B}?", False),
    ("town", "population", "Which town has the larger population, {A} or {B}?", True),
    ("mountain", "height", "Which mountain is taller, {A} or {B}?", True),
    ("river", "length", "Which river is longer, {A} or {B}?", True),
    ("work", "year", "Which came out first, {A} or {B}?", False)]
SAME = [  # (type, attribute, yes/no question)
    ("person", "occupation", "Are {A} and {B} both {v}s?"),
    ("person", "birthplace", "Were {A} and {B} born in the same town?"),
    ("town", "country", "Are {A} and {B} in the same country?"),
    ("company", "industry", "Do {A} and {B} operate in the same industry?")]


def comparison(rng, w, where, said, pool, tries=400):
    def row(group, q, ans, a, b, attr, compare):
        pa, pb = where[(a["i"], attr)], where[(b["i"], attr)]
        return dict(type="comparison", group=group, names=[a["i"], b["i"]], answers=ans, question=q,
                    sup=[pa, pb], checks=[(pa, answers(w, a, attr)[0]), (pb, answers(w, b, attr)[0])],
                    chain=[chain_step(w, where, said, a, attr), chain_step(w, where, said, b, attr)],
                    compare=compare)

    for type_, attr, q, larger in WHICH:
        ents = [e for e in w.ents if e["type"] == type_ and e["i"] in pool]
        for _ in range(tries if len(ents) > 1 else 0):
            a, b = rng.sample(ents, 2)
            if a["a"][attr] != b["a"][attr]:
                win = max(a, b, key=lambda e: e["a"][attr] * (1 if larger else -1))
                yield row((type_, attr), q.format(A=ref(a), B=ref(b)), aliases(win), a, b, attr,
                          "larger" if larger else "smaller")
    for type_, attr, q in SAME:
        ents = [e for e in w.ents if e["type"] == type_ and e["i"] in pool]
        by_value = {}
        for e in ents:
            by_value.setdefault(e["a"][attr], []).append(e)
        twins = [g for g in by_value.values() if len(g) > 1]
        for k in range(tries if len(ents) > 1 else 0):
            if k % 2 == 0 and twins:  # a "yes" pair shares the value
                a, b = rng.sample(rng.choice(twins), 2)
            else:
                a, b = rng.sample(ents, 2)
            same = a["a"][attr] == b["a"][attr]
            text = q.format(A=a["name"], B=b["name"], v=a["a"][attr])
            yield row((type_, attr, same), text, ["yes" if same else "no"], a, b, attr, "same")


def sample(rng, cands, n, taken):
    """n questions, choosing a group uniformly at random each time (so question kinds stay mixed)."""
    groups = {}
    for c in cands:
        groups.setdefault(c["group"], []).append(c)
    keys, out = sorted(groups, key=repr), []
    while len(out) < n and keys:
        k = rng.choice(keys)
        c = groups[k].pop(rng.randrange(len(groups[k])))
        if not groups[k]:
            keys.remove(k)
        if c["question"] not in taken:
            taken.add(c["question"])
            out.append(c)
    return out


# ---------------------------------------------------------------------------------------------
# 7. Main: build, check every question against its passages, write byte-stable JSONL
# ---------------------------------------------------------------------------------------------
def metadata(c):
    """A question row's metadata: its type, supporting passages and reasoning chain."""
    meta = {"type": c["type"], "supporting_ids": [str(p) for p in c["sup"]], "chain": c["chain"]}
    if "compare" in c:
        meta["compare"] = c["compare"]
    return meta


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "toy"),
                    help="output folder (data/toy beside this script)")
    for flag, default in (("--seed", 0), ("--passages", 3000), ("--train", 2000), ("--test", 200)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--avoid_seed", type=int, default=0,
                    help="no entity may take a name of this seed's world (ignored when it is --seed; -1: none)")
    args = ap.parse_args()
    reserved = set()
    if args.avoid_seed not in (-1, args.seed):  # a second world for transfer: every name is new
        reserved = build_world(random.Random(args.avoid_seed), args.passages).used
    rng = random.Random(args.seed)
    w = build_world(rng, args.passages, reserved)
    corpus, where, said = make_passages(rng, w, args.passages)
    texts = [c["contents"] for c in corpus]

    # Entities named by test questions are never named by train questions.
    frac = min(0.5, 1.3 * args.test / max(1, args.train + args.test))
    test_pool = set(rng.sample(range(len(w.ents)), round(frac * len(w.ents))))
    train_pool = set(range(len(w.ents))) - test_pool
    taken, splits = set(), {}
    for split, n, pool in (("test", args.test, test_pool), ("train", args.train, train_pool)):
        inside = lambda c: all(i in pool for i in c["names"])
        n_single, n_bridge = round(0.5 * n), round(0.3 * n)
        rows = (sample(rng, [c for c in single_hop(w, where, said) if inside(c)], n_single, taken)
                + sample(rng, [c for c in bridge(w, where, said) if inside(c)], n_bridge, taken)
                + sample(rng, list(comparison(rng, w, where, said, pool)), n - n_single - n_bridge, taken))
        rng.shuffle(rows)
        for c in rows:
            for pid, s in c["checks"] + [(int(h["passage_id"]), h["fact"]) for h in c["chain"]]:
                assert s in texts[pid], (c["question"], s, texts[pid])
        splits[split] = [{"id": f"{split}_{k}", "question": c["question"], "golden_answers": c["answers"],
                          "metadata": metadata(c)} for k, c in enumerate(rows)]
    assert not {r["question"] for r in splits["train"]} & {r["question"] for r in splits["test"]}

    os.makedirs(args.out, exist_ok=True)
    write_jsonl(os.path.join(args.out, "corpus.jsonl"), corpus)
    for split in ("train", "test"):
        write_jsonl(os.path.join(args.out, f"{split}.jsonl"), splits[split])
    kinds = {s: {t: sum(r["metadata"]["type"] == t for r in splits[s]) for t in ("single", "bridge", "comparison")}
             for s in splits}
    print(f"{len(w.ents)} entities, {len(corpus)} passages; train {kinds['train']}; test {kinds['test']} -> {args.out}")


if __name__ == "__main__":
    main()
