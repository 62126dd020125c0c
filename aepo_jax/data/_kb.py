"""A generated fictional knowledge base: invented people, cities and companies, one document each.

Names are built from syllables and every name token is unique, so a fact can only be found by
searching this corpus (a small model cannot know it) and BM25 finds the right page by name.
"""

from __future__ import annotations

import dataclasses
import random

_ONSETS = [
  "b",
  "d",
  "f",
  "g",
  "k",
  "l",
  "m",
  "n",
  "p",
  "r",
  "s",
  "t",
  "v",
  "z",
  "br",
  "dr",
  "kr",
  "st",
  "tr",
  "vel",
  "th",
  "qu",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ei"]
_CODAS = ["", "n", "r", "s", "l", "x", "sk", "nd", "th"]
_PROFESSIONS = [
  "glassmaker",
  "cartographer",
  "botanist",
  "engineer",
  "violinist",
  "architect",
  "chemist",
  "sculptor",
  "astronomer",
  "beekeeper",
  "linguist",
  "surgeon",
]
# Optional closing remarks of varying length: documents differ in length, so BM25 scores rarely tie.
_REMARKS = [
  "",
  "",
  "Old almanacs mention this.",
  "Little else is recorded.",
  "Records describe this in detail.",
  "Many letters about this survive in the archives.",
  "A famous travel diary mentions this.",
  "Historians still debate some details.",
]
_SUFFIXES = ["Foundry", "Works", "Labs", "Textiles", "Shipping", "Optics", "Mills", "Dynamics"]


@dataclasses.dataclass
class City:
  name: str
  country: str
  founded: int
  population: int


@dataclasses.dataclass
class Person:
  name: str
  born: int
  city: str
  profession: str
  employer: str = ""


@dataclasses.dataclass
class Company:
  name: str
  founded: int
  city: str
  employees: int
  founder: str = ""


def _article(word: str) -> str:
  return "an" if word[0] in "aeiou" else "a"


class _Names:
  def __init__(self, rng: random.Random):
    self.rng, self.used = rng, set()

  def word(self, syllables: int) -> str:
    while True:
      w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
      w = (w + self.rng.choice(_CODAS)).capitalize()
      if w.lower() not in self.used and len(w) >= 4:
        self.used.add(w.lower())
        return w


@dataclasses.dataclass
class KnowledgeBase:
  cities: list[City]
  people: list[Person]
  companies: list[Company]

  remarks: list[str] = dataclasses.field(default_factory=list)

  def documents(self) -> list[dict]:
    """Corpus records {"id", "contents"}; contents = '"Title"\\ntext' (Search-R1 corpus layout)."""
    docs = []
    for c in self.cities:
      docs.append(
        (
          c.name,
          f"{c.name} is a city in {c.country}. It was founded in {c.founded} and has a population of {c.population}.",
        )
      )
    for p in self.people:
      docs.append(
        (
          p.name,
          f"{p.name} is {_article(p.profession)} {p.profession} born in {p.born} in {p.city}. "
          f"{p.name} works for {p.employer}.",
        )
      )
    for co in self.companies:
      docs.append(
        (
          co.name,
          f"{co.name} is a company founded in {co.founded} by {co.founder}. "
          f"Its headquarters are in {co.city} and it employs {co.employees} people.",
        )
      )
    remarks = self.remarks or [""] * len(docs)
    return [
      {"id": str(i), "contents": f'"{title}"\n{text} {remark}'.rstrip()}
      for i, ((title, text), remark) in enumerate(zip(docs, remarks))
    ]


def generate_kb(rng: random.Random, n_people: int) -> KnowledgeBase:
  names = _Names(rng)
  countries = [names.word(2) + "ia" for _ in range(4)]
  cities = [
    City(names.word(rng.choice([2, 3])), rng.choice(countries), rng.randint(1100, 1899), rng.randint(10_000, 999_999))
    for _ in range(max(4, n_people // 2))
  ]
  companies = [
    Company(
      f"{names.word(2)} {rng.choice(_SUFFIXES)}",
      rng.randint(1850, 2015),
      rng.choice(cities).name,
      rng.randint(100, 99_999),
    )
    for _ in range(max(4, n_people // 2))
  ]
  people = [
    Person(
      f"{names.word(2)} {names.word(2)}",
      rng.randint(1850, 1995),
      rng.choice(cities).name,
      rng.choice(_PROFESSIONS),
      rng.choice(companies).name,
    )
    for _ in range(max(n_people, 4))
  ]
  for co, founder in zip(companies, rng.sample(people, len(companies))):  # one company each
    co.founder = founder.name
  remarks = [rng.choice(_REMARKS) for _ in range(len(cities) + len(people) + len(companies))]
  return KnowledgeBase(cities, people, companies, remarks)
