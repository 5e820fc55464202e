"""The built-in suite ``invoices-50``: invoices and receipts with their ground truth, made deterministically.

Twenty documents in Hungarian, English and German, each written with its own
language's date and amount formats (``2026. szeptember 3.``, ``12 345 Ft``;
``3 September 2026``, ``1,234.50``; ``3. September 2026``, ``1.234,50 €``) and
with line items whose amounts are not the total (the distractors an extraction
gets wrong). Each invoice carries three tasks and each receipt two, with
different questions and schemas on the same document, so tasks share prompt
prefixes as tasks A and B did in production: 10 x 3 + 10 x 2 = 50 tasks. The
answers are normalised (ISO dates, plain numbers), so a model must convert
what it reads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvwarden.probe.suite import Task

SUITES = ("invoices-50",)
HU_MONTHS = ("január", "február", "március", "április", "május", "június", "július", "augusztus", "szeptember",
             "október", "november", "december")  # fmt: skip
EN_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
             "November", "December")  # fmt: skip
DE_MONTHS = ("Januar", "Februar", "März", "April", "Mai", "Juni", "Juli", "August", "September", "Oktober",
             "November", "Dezember")  # fmt: skip
ISSUERS = {
    "hu": ("Kovács és Társa Kft.", "Duna Nyomda Zrt.", "Tisza Fuvar Bt.", "Balaton Szerviz Kft."),
    "en": ("Harbour Freight Ltd", "Greenfield Office Supply", "Northgate Printing Co.", "Riverside Catering"),
    "de": ("Müller & Söhne GmbH", "Bergmann Logistik AG", "Rhein Druckerei KG", "Schäfer Bürobedarf GmbH"),
}
ITEMS = {
    "hu": ("Irodai papír", "Nyomtatópatron", "Szállítási díj", "Karbantartás", "Tanácsadás (óra)"),
    "en": ("Office paper", "Printer cartridge", "Delivery", "Maintenance", "Consulting (hour)"),
    "de": ("Büropapier", "Druckerpatrone", "Lieferung", "Wartung", "Beratung (Stunde)"),
}
CURRENCY = {"hu": "HUF", "en": "GBP", "de": "EUR"}
DATE_SCHEMA = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}


@dataclass(frozen=True)
class Document:
    language: str
    kind: str  # invoice | receipt
    number: str
    issuer: str
    issued: tuple[int, int, int]  # year, month, day
    due: tuple[int, int, int]
    items: tuple[tuple[str, int, float], ...]  # name, quantity, unit price
    currency: str

    @property
    def total(self) -> float:
        return round(sum(q * p for _, q, p in self.items), 2)


def local_date(lang: str, d: tuple[int, int, int]) -> str:
    y, m, day = d
    if lang == "hu":
        return f"{y}. {HU_MONTHS[m - 1]} {day}."
    if lang == "de":
        return f"{day}. {DE_MONTHS[m - 1]} {y}"
    return f"{day} {EN_MONTHS[m - 1]} {y}"


def local_amount(lang: str, value: float) -> str:
    if lang == "hu":  # forints have no fractional part in practice; thousands by a space
        return f"{round(value):,}".replace(",", " ") + " Ft"
    if lang == "de":
        return f"{value:,.2f}".replace(",", "_").replace(".", ",").replace("_", ".") + " €"
    return f"£{value:,.2f}"


def iso(d: tuple[int, int, int]) -> str:
    return f"{d[0]:04d}-{d[1]:02d}-{d[2]:02d}"


def render(doc: Document) -> str:
    """The document's text, in its language."""
    lang = doc.language
    lines = [f"{local_amount(lang, p * q)}  {q} x {name} ({local_amount(lang, p)})" for name, q, p in doc.items]
    words = {
        "hu": ("SZÁMLA" if doc.kind == "invoice" else "NYUGTA", "Sorszám", "Kiállító", "Kelt", "Fizetési határidő",
               "Tételek", "Fizetendő összesen"),
        "en": ("INVOICE" if doc.kind == "invoice" else "RECEIPT", "Number", "From", "Date", "Payment due",
               "Items", "Total due"),
        "de": ("RECHNUNG" if doc.kind == "invoice" else "QUITTUNG", "Nummer", "Aussteller", "Datum", "Zahlbar bis",
               "Positionen", "Gesamtbetrag"),
    }[lang]  # fmt: skip
    title, number, issuer, date, due, items, total = words
    out = [title, f"{number}: {doc.number}", f"{issuer}: {doc.issuer}", f"{date}: {local_date(lang, doc.issued)}"]
    if doc.kind == "invoice":
        out.append(f"{due}: {local_date(lang, doc.due)}")
    out += [f"{items}:", *lines, f"{total}: {local_amount(lang, doc.total)}"]
    return "\n".join(out)


def _document(rng: random.Random, i: int) -> Document:
    lang = ("hu", "en", "de", "hu", "en")[i % 5]
    kind = "invoice" if i % 2 == 0 else "receipt"
    month, day = rng.randint(1, 12), rng.randint(1, 28)
    due_month = month % 12 + 1
    items = []
    for name in rng.sample(ITEMS[lang], rng.randint(2, 4)):
        price = rng.randint(8, 400) * 100 if lang == "hu" else rng.randint(300, 40000) / 100
        items.append((name, rng.randint(1, 9), float(price)))
    prefix = {"hu": "2026/", "en": "INV-2026-", "de": "RE-2026-"}[lang]
    return Document(lang, kind, f"{prefix}{rng.randint(100, 999)}", rng.choice(ISSUERS[lang]), (2026, month, day),
                    (2026 if due_month > month else 2027, due_month, day), tuple(items), CURRENCY[lang])  # fmt: skip


def _obj(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _tasks(doc: Document, i: int) -> list[Task]:
    text, meta = render(doc), {"language": doc.language, "kind": doc.kind, "document": i}
    amount = round(doc.total) if doc.language == "hu" else doc.total
    amount_type = "integer" if doc.language == "hu" else "number"
    tasks = [
        Task(f"doc{i:02d}-date", text, f"When was this {doc.kind} issued? Give the date as YYYY-MM-DD.",
             {"date": iso(doc.issued)}, _obj({"date": DATE_SCHEMA}), meta),
        Task(f"doc{i:02d}-total", text, f"What is the total amount of this {doc.kind}, and in which currency?",
             {"amount": amount, "currency": doc.currency},
             _obj({"amount": {"type": amount_type}, "currency": {"enum": ["HUF", "EUR", "GBP", "USD"]}}), meta),
    ]  # fmt: skip
    if doc.kind == "invoice":
        tasks.append(
            Task(f"doc{i:02d}-due", text, "What is the invoice number, and when is payment due (YYYY-MM-DD)?",
                 {"number": doc.number, "due_date": iso(doc.due)},
                 _obj({"number": {"type": "string", "maxLength": 16}, "due_date": DATE_SCHEMA}), meta)
        )  # fmt: skip
    return tasks


def builtin_suite(name: str) -> list[Task]:
    """A built-in suite by name (see :data:`SUITES`); the same tasks on every machine."""
    if name not in SUITES:
        raise ValueError(f"--suite: unknown built-in {name!r}; expected one of {SUITES} or a .jsonl file")
    rng = random.Random(2026)
    return [task for i in range(20) for task in _tasks(_document(rng, i), i)]
