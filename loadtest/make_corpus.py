"""Write data/corpus.jsonl: a few hundred LLM-style answers from templates.

Run `python -m loadtest.make_corpus [--count 320] [--seed 7]`; the output is
deterministic for a seed. Answers mix lengths (one sentence to long lists),
numbers in many forms (3.5%, $1,299, 14:30, 2.75 km), markdown lists and bold
marks an LLM would send, and about one in ten is Chinese.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from loadtest.corpus import default_corpus_path

# topic: (question, steps, facts, tips)
_TOPICS: dict[str, tuple[str, list[str], list[str], list[str]]] = {
    "sourdough": (
        "bake a loaf of sourdough",
        ["Feed your starter 6 to 8 hours ahead so it is active and bubbly",
         "Mix 500 g of flour with 350 g of water and let it rest for 45 minutes",
         "Add 100 g of starter and 10 g of salt, then squeeze until combined",
         "Do 4 sets of stretch and folds, about 30 minutes apart",
         "Shape the dough, put it in a floured basket and refrigerate overnight",
         "Bake at 250 °C in a covered pot for 20 minutes, then 25 more uncovered"],
        ["A dough at 70% hydration is a good place to start.",
         "Cold proofing for 12 to 16 hours deepens the flavor.",
         "The starter is ready when it roughly doubles within 4 to 6 hours."],
        ["Use a kitchen scale rather than cups.",
         "Let the loaf cool for at least an hour before slicing."]),
    "python": (
        "speed up a slow Python script",
        ["Profile first with cProfile so you know where the time really goes",
         "Replace Python loops over numbers with NumPy operations",
         "Cache repeated results with functools.lru_cache",
         "Move I/O-bound work to asyncio or a thread pool",
         "Use a set instead of a list for membership tests",
         "Try PyPy or Cython for the hot loop if nothing else helps"],
        ["A membership test on a set takes O(1) time on average, versus O(n) for a list.",
         "Vectorized NumPy code is often 10 to 100 times faster than a plain loop.",
         "The global interpreter lock means threads rarely help CPU-bound code."],
        ["Measure before and after every change.", "Keep the fast path simple and readable."]),
    "travel": (
        "plan a 5-day trip to Japan",
        ["Book flights into Tokyo and out of Osaka to avoid backtracking",
         "Spend days 1 and 2 in Tokyo: Asakusa, Shibuya and a day trip to Nikko",
         "Take the shinkansen to Kyoto on day 3; the ride takes about 2 hours 15 minutes",
         "Visit Fushimi Inari early, before 8 a.m., to beat the crowds",
         "Finish in Osaka with street food in Dotonbori on day 5",
         "Get a Suica or ICOCA card for trains, buses and convenience stores"],
        ["A 7-day Japan Rail Pass costs about 50,000 yen.",
         "Cherry blossoms usually peak in late March or early April.",
         "Most trains run between 5 a.m. and midnight."],
        ["Carry some cash, since smaller shops may not take cards.",
         "Reserve popular restaurants a few weeks ahead."]),
    "budget": (
        "build a monthly budget",
        ["Add up your take-home pay for the month",
         "List fixed costs such as rent, insurance and loan payments",
         "Track variable spending for 30 days to see where the money goes",
         "Apply the 50/30/20 rule: 50% needs, 30% wants, 20% savings",
         "Automate a transfer to savings on payday",
         "Review the numbers every month and adjust"],
        ["An emergency fund of 3 to 6 months of expenses is the usual target.",
         "At 4.5% interest, $10,000 earns about $450 in a year.",
         "Credit card interest often runs above 20% a year."],
        ["Pay off the highest-interest debt first.",
         "Round numbers are fine; consistency matters more."]),
    "running": (
        "train for your first 10K",
        ["Start with 3 runs a week of 20 to 30 minutes at an easy pace",
         "Add about 10% to your weekly distance each week",
         "Include one longer run that builds from 5 km to 12 km",
         "Do one session of intervals, such as 6 x 400 m with rests",
         "Take a rest day after every hard session",
         "Taper in the final week by cutting the distance by a third"],
        ["Most beginners finish a 10K in 55 to 75 minutes.",
         "An easy pace is one at which you can still hold a conversation.",
         "Training plans for a first 10K usually last 8 to 10 weeks."],
        ["Replace running shoes every 600 to 800 km.", "Sleep counts as training too."]),
    "garden": (
        "start a vegetable garden",
        ["Pick a spot that gets at least 6 hours of sun a day",
         "Test the soil; most vegetables like a pH between 6.0 and 7.0",
         "Start small, with a bed of about 1.2 m by 2.4 m",
         "Plant easy crops first: lettuce, radishes, beans and zucchini",
         "Water deeply twice a week rather than a little every day",
         "Mulch with 5 cm of straw to keep moisture in and weeds out"],
        ["Radishes can be ready to harvest in as little as 25 days.",
         "Tomatoes need night temperatures above 10 °C to set fruit.",
         "A single zucchini plant can produce more than 5 kg in a season."],
        ["Keep a notebook of what you planted and when.", "Rotate crops each year."]),
    "laptop": (
        "choose a laptop for programming",
        ["Get at least 16 GB of RAM; 32 GB if you run containers",
         "Pick an SSD of 512 GB or more",
         "Look for a screen of at least 1920 x 1080, ideally with good brightness",
         "Check the keyboard, since you will type on it all day",
         "Prefer at least 8 hours of real battery life",
         "Make sure your operating system of choice is well supported"],
        ["A modern 8-core CPU compiles large projects in a fraction of the time of a 4-core one.",
         "Laptops around $1,299 usually hit the sweet spot of price and performance.",
         "Many developers use an external monitor at 27 inches."],
        ["Read reviews about thermals and fan noise.",
         "Buy more storage than you think you need."]),
    "sleep": (
        "sleep better",
        ["Go to bed and get up at the same time every day, weekends included",
         "Keep the bedroom cool, around 18 °C, dark and quiet",
         "Stop caffeine after 2 p.m.",
         "Put screens away 30 to 60 minutes before bed",
         "Get bright daylight within an hour of waking",
         "If you cannot sleep after 20 minutes, get up and read until sleepy"],
        ["Most adults need 7 to 9 hours of sleep a night.",
         "Caffeine has a half-life of about 5 hours.",
         "A short nap of 20 minutes can improve alertness without grogginess."],
        ["Alcohol may help you fall asleep but it worsens sleep quality.",
         "See a doctor if you snore loudly or wake up gasping."]),
    "git": (
        "undo a commit in Git",
        ["Run git log --oneline to find the commit you want to undo",
         "To keep the changes but drop the commit, use git reset --soft HEAD~1",
         "To throw the changes away as well, use git reset --hard HEAD~1",
         "If the commit was already pushed, prefer git revert, which adds a new commit",
         "Push the result; after a reset you will need git push --force-with-lease",
         "Tell your teammates if you rewrote shared history"],
        ["git revert is safe on shared branches because it does not rewrite history.",
         "The reflog keeps old commits for about 90 days by default.",
         "HEAD~1 means the commit before the current one."],
        ["Make a backup branch before any hard reset.", "Small commits are easier to undo."]),
    "coffee": (
        "brew better coffee at home",
        ["Buy whole beans roasted within the last 2 to 4 weeks",
         "Grind right before brewing, medium-fine for pour-over",
         "Use a ratio of about 1 to 16, for example 20 g of coffee to 320 g of water",
         "Heat the water to 92 to 96 °C",
         "Bloom the grounds with twice their weight in water for 30 to 45 seconds",
         "Pour slowly in circles and aim for a total brew time of 3 minutes"],
        ["Water makes up more than 98% of a cup of coffee.",
         "A burr grinder gives a far more even grind than a blade grinder.",
         "Light roasts usually have slightly more caffeine by weight."],
        ["Taste and change one variable at a time.", "Store beans in an airtight container."]),
    "solar": (
        "decide whether solar panels are worth it",
        ["Check how many hours of sun your roof gets and which way it faces",
         "Look at 12 months of electricity bills to find your yearly usage",
         "Get at least 3 quotes from installers",
         "Compare the cost per watt; $2.50 to $3.50 is typical",
         "Ask about incentives and net metering in your area",
         "Work out the payback period from the savings per year"],
        ["A typical home system of 6 kW costs around $18,000 before incentives.",
         "Panels usually carry a 25-year performance warranty.",
         "Output drops by roughly 0.5% a year as panels age."],
        ["South-facing roofs work best in the northern hemisphere.",
         "Batteries add cost but help during outages."]),
    "history": (
        "understand why the Roman Empire fell",
        ["Start with the crisis of the third century, when 26 emperors ruled in 50 years",
         "Look at the split into eastern and western halves in 395",
         "Consider the pressure of migrating peoples such as the Goths and Huns",
         "Weigh the economic problems: debased coins, high taxes and shrinking trade",
         "Note that the western empire ended in 476, while the east lasted until 1453",
         "Compare the views of historians, from Gibbon to modern scholars"],
        ["Edward Gibbon published the first volume of his history in 1776.",
         "At its height around 117 AD, the empire covered about 5 million square kilometers.",
         "Constantinople was founded as the new capital in 330."],
        ["There is no single cause; most historians stress several.",
         "Primary sources are patchy, so treat precise numbers with care."]),
}

_OPENERS = ["Sure!", "Great question!", "Absolutely.", "Of course.", "Happy to help.",
            "Good question.", "Here's a quick answer.", "Certainly!", "Let's break it down."]
_CLOSERS = ["Let me know if you'd like more detail on any step.",
            "Would you like me to go deeper into any of these?",
            "I hope this helps!", "Want a printable checklist version?",
            "Feel free to ask if anything is unclear.",
            "If you tell me more about your situation, I can tailor this."]

_ZH_TOPICS = [
    ("做番茄炒蛋", ["鸡蛋打散，加一小撮盐", "番茄切块，大约切成8块",
               "热锅下油，先炒鸡蛋到七成熟盛出", "再炒番茄，加1勺糖和少许盐",
               "倒回鸡蛋，翻炒30秒即可出锅"],
     "这道菜一般10分钟就能做好。"),
    ("提高学习效率", ["每次专注25分钟，然后休息5分钟", "把大任务拆成小目标", "睡前复习当天的重点",
                "每周做一次总结", "减少手机通知的干扰"],
     "研究表明，间隔复习比集中突击的记忆效果好很多。"),
    ("准备面试", ["研究公司的业务和产品", "准备3到5个自己的项目故事", "练习常见问题的回答",
              "提前15分钟到达", "面试后24小时内发感谢邮件"],
     "大多数面试在45到60分钟之间。"),
    ("去北京旅游", ["第1天去故宫和天安门", "第2天爬长城，推荐慕田峪", "第3天逛颐和园",
               "晚上可以去南锣鼓巷吃小吃", "提前在网上预约门票"],
     "故宫每天限流4万人，旺季一定要提前预约。"),
    ("开始跑步", ["先从每周3次、每次20分钟开始", "配速以能说话为准", "每周增加不超过10%的距离",
              "跑前热身5分钟", "选一双合适的跑鞋"],
     "坚持8周左右，大多数人就能轻松跑完5公里。"),
    ("存钱", ["每月工资到账先存20%", "记录每一笔开销", "取消不常用的会员订阅",
            "准备3到6个月的应急资金", "优先还清高利息的信用卡"],
     "如果每月存2000元，年利率3%，5年后大约能有12.9万元。"),
]
_ZH_OPENERS = ["好的！", "当然可以。", "这是个好问题。", "没问题，"]
_ZH_CLOSERS = ["希望对你有帮助！", "如果还有问题，随时问我。", "需要更详细的说明吗？"]


def _numbers_answer(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        principal = rng.choice([1000, 2500, 5000, 12000])
        rate = rng.choice([3.5, 4.25, 5.0, 7.5])
        years = rng.choice([3, 5, 10])
        total = principal * (1 + rate / 100) ** years
        return (f"{rng.choice(_OPENERS)} At {rate}% a year, compounded annually, "
                f"${principal:,} grows to about ${total:,.2f} after {years} years. "
                f"That is ${total - principal:,.2f} in interest.")
    if kind == 1:
        km = rng.choice([5, 10, 21.1, 42.195])
        minutes = round(km * rng.uniform(4.5, 7.5))
        pace = minutes / km
        whole = minutes // 60
        span = f"{whole} hour{'s' if whole != 1 else ''} and " if whole else ""
        return (f"To cover {km} km in {span}{minutes % 60} minutes, "
                f"you need an average pace of about {int(pace)}:{int(pace % 1 * 60):02d} per km. "
                f"In miles that is roughly {km * 0.621371:.2f} miles.")
    if kind == 2:
        celsius = rng.randrange(-10, 40)
        return (f"{celsius} °C is {celsius * 9 / 5 + 32:.1f} °F. A quick way to estimate it "
                "is to double the Celsius value and add 30, which gets you close.")
    hours = rng.randrange(1, 12)
    mins = rng.choice([0, 15, 30, 45])
    offset = rng.choice([-8, -5, 1, 8, 9])
    local = (14 + offset) % 24
    return (f"If it is 14:{mins:02d} in London, it is {local}:{mins:02d} where you are, "
            f"given a UTC offset of {offset:+d} hours. A meeting {hours} hours later "
            f"would start at {(local + hours) % 24}:{mins:02d} local time.")


def _bold_lead(step: str) -> str:
    words = step.split()
    return f"- **{' '.join(words[:3])}** {' '.join(words[3:])}."


def _english_answer(rng: random.Random) -> str:
    question, steps, facts, tips = _TOPICS[rng.choice(sorted(_TOPICS))]
    shape = rng.choices(["short", "paragraph", "steps", "bullets", "numbers", "long"],
                        weights=[3, 3, 4, 2, 2, 2])[0]
    if shape == "numbers":
        return _numbers_answer(rng)
    opener = rng.choice(_OPENERS)
    if shape == "short":
        return f"{opener} {rng.choice(facts)}"
    if shape == "paragraph":
        chosen = rng.sample(facts, k=rng.randint(2, 3)) + rng.sample(tips, k=1)
        return (f"{opener} If you want to {question}, keep a few things in mind. "
                + " ".join(chosen) + " " + rng.choice(_CLOSERS))
    if shape == "steps":
        count = rng.randint(3, len(steps))
        lines = [f"{i}. {step}." for i, step in enumerate(steps[:count], start=1)]
        return (f"{opener} Here's how to {question}:\n\n" + "\n".join(lines)
                + f"\n\n{rng.choice(facts)} {rng.choice(_CLOSERS)}")
    if shape == "long":
        lines = [f"{i}. {step}." for i, step in enumerate(steps, start=1)]
        return (f"{opener} To {question}, it helps to understand a few basics first. "
                + " ".join(facts) + "\n\nWith that in mind, here is a plan you can follow:\n\n"
                + "\n".join(lines) + "\n\nA couple of extra tips:\n\n"
                + "\n".join(f"- {tip}" for tip in tips) + f"\n\n{rng.choice(_CLOSERS)}")
    picked = rng.sample(steps, k=rng.randint(3, 4))
    lines = [_bold_lead(step) for step in picked]
    return (f"{opener} The main points when you {question}:\n\n" + "\n".join(lines)
            + f"\n\n**Tip:** {rng.choice(tips)}")


def _chinese_answer(rng: random.Random) -> str:
    topic, steps, fact = rng.choice(_ZH_TOPICS)
    opener = rng.choice(_ZH_OPENERS)
    if rng.random() < 0.35:
        return f"{opener}关于{topic}，{fact}{rng.choice(_ZH_CLOSERS)}"
    count = rng.randint(3, len(steps))
    lines = [f"{i}. {step}。" for i, step in enumerate(steps[:count], start=1)]
    return (f"{opener}{topic}可以按照下面的步骤：\n\n" + "\n".join(lines)
            + f"\n\n{fact}{rng.choice(_ZH_CLOSERS)}")


def generate(count: int, seed: int) -> list[dict[str, str]]:
    """`count` distinct answers (about 1 in 10 Chinese), deterministic for `seed`."""
    if count < 1:
        raise ValueError(f"expected count >= 1, got {count}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    for _ in range(count * 50):
        lang = "zh" if rng.random() < 0.125 else "en"
        text = _chinese_answer(rng) if lang == "zh" else _english_answer(rng)
        if text in seen:
            continue
        seen.add(text)
        out.append({"id": f"a{len(out):03d}", "lang": lang, "text": text})
        if len(out) == count:
            return out
    raise ValueError(f"templates yield only {len(out)} distinct answers, expected {count}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=320)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=default_corpus_path())
    args = parser.parse_args(argv)
    answers = generate(args.count, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for item in answers:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    print(f"wrote {len(answers)} answers to {args.out}")


if __name__ == "__main__":
    main()
