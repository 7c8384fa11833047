/**
 * The English text the built-in tokenizer learns its merges from: original prose about model serving,
 * weather, cooking, travel and gardening, a short story, questions and answers, benchmarking notes and
 * code-like lines, with a few non-ASCII words (café, Straße, 東京, Привет, 🙂) so multi-byte tokens exist.
 *
 * Changing this text changes the generated tokenizer: bump GENERATOR_VERSION when you do.
 */
export const CORPUS = String.raw`How a language model answers a question, one token at a time

When you send a question to a language model, the answer does not arrive all at once. The model reads your prompt, turns it into a list of tokens, and then predicts the next token, and the next, and the next, until it decides to stop or reaches the limit you set. Each prediction is called a decoding step. A token is usually a short piece of a word: a common word such as "the" or "model" is one token, while a rare word is split into several smaller pieces. Because every step depends on the one before it, the answer is produced in order, and a good server sends each piece to the client as soon as it is ready. That is what we mean by streaming.

Streaming matters because people read while they wait. If the first words appear after a fraction of a second, the answer feels fast even when the full reply takes ten seconds. The time until the first token is shown is called the time to first token, and the time between two tokens is called the inter-token latency. A serving system tries to keep both of them low while it also serves as many users as possible on the same hardware. These two goals pull in different directions, and most of the engineering work in a serving system is about finding a fair balance between them.

The first part of every request is the prefill. During the prefill the model reads the whole prompt in one pass and fills its key and value cache. The cache holds, for every layer and every attention head, the keys and values of all the tokens seen so far. Without the cache the model would have to read the entire text again for every new token, which would make long answers very slow. With the cache, each decoding step only needs to process one new token per sequence, and it looks back at the stored keys and values to decide what to write next.

A single request rarely keeps a processor busy. The matrix products of one decoding step are small, and a lot of time is spent moving weights from memory rather than doing arithmetic. So servers group many requests into one batch and run them together. The weights are read once and used for every sequence in the batch. This is why batching raises throughput so much: the cost of reading the weights is shared by everyone.

Static batching waits until a group of requests is ready, runs them together, and returns when the longest one is finished. It is simple, but it wastes time, because short answers sit idle while the long ones keep going, and new requests must wait for the whole batch to finish. Continuous batching fixes this. After every decoding step the scheduler looks at the batch again: finished sequences leave, new ones join, and the batch keeps moving. A request that arrives in the middle of a long answer does not have to wait for it. It joins at the next step, runs its prefill, and starts streaming.

Sequences in a batch have different lengths. To run them in one tensor, the shorter ones are padded. Padding on the left keeps the newest token of every sequence in the last column, which makes the next step easy: every sequence appends exactly one token at the end. The attention mask tells the model which positions are real and which are padding, so the padding never changes the answer. Each sequence also keeps its own position ids, counted from its own first real token. Done right, a sequence in a batch produces exactly the same tokens as it would produce alone.

The gateway is the part of the system that speaks to clients. It accepts an HTTP request, checks that the request is valid, puts a job on a queue, and keeps the connection open. When tokens arrive from a worker, the gateway writes them to the client as server-sent events. Each event is a line that starts with "data:" and ends with a blank line. A comment line that starts with a colon can be sent as a heartbeat, so that proxies and load balancers do not close a quiet connection. When the answer is done, the gateway sends a final event and closes the stream.

The worker is the part that runs the model. It takes jobs from the queue, adds them to its batch, and publishes the new text of every sequence after every step. The worker does not know anything about HTTP. It only knows about requests, tokens, and text. If a client goes away, the gateway sends a cancel message, and the worker removes the sequence from the batch at the next step, so no time is wasted on an answer that nobody will read.

Detokenization is harder than it looks. A token does not always end at a character boundary. An emoji or a Chinese character is several bytes long in UTF-8, and a byte-level tokenizer may split those bytes across two or three tokens. If the server sent the text of each token on its own, the client would see broken characters. A streaming detokenizer therefore holds back any incomplete byte sequence and releases it when the rest of the character arrives. It also holds back text that might be the start of a stop string, and releases it only when it is clear that the stop string did not match.

Stop conditions end a sequence. The model may produce its end-of-sequence token, the answer may reach the maximum number of tokens, or the text may contain one of the stop strings the client asked for. The reason is reported to the client as the finish reason: "stop" when the model or a stop string ended the answer, and "length" when the limit was reached. Usage counts report how many tokens were in the prompt and how many were generated, which is what most services use for billing.

Queues and timeouts protect the system when it is busy. If more requests arrive than the workers can handle, the queue grows, and the time each request waits before it starts grows with it. A good gateway rejects new work early when the queue is too long, with a clear error and a hint to retry later, instead of letting every client wait until its own timeout. It also measures the queue time, the time to first token, and the end-to-end latency of every request, so that operators can see what is happening and plan capacity.

Sampling decides which token comes next. Greedy decoding always picks the most likely token. It is deterministic, which makes it useful for tests, but it can be dull and repetitive. Temperature sampling divides the scores by a number before turning them into probabilities: a low temperature makes the choice sharper, a high temperature makes it more random. Top-k sampling keeps only the k most likely tokens, and top-p sampling keeps the smallest set of tokens whose probabilities add up to p. A seed makes sampling repeatable, which helps when you want to reproduce an answer.

Memory is the main limit on batch size. The weights take a fixed amount of memory, but the key and value cache grows with every token of every sequence. A long context and a large batch together can fill the memory quickly. Some servers split the cache into fixed-size blocks, like pages in an operating system, so that memory is not wasted on space that a sequence might never use. Others simply cap the number of sequences and the context length. Either way, the scheduler has to know how much memory each sequence needs before it admits the request.

Testing a serving system needs a model that is small, fast, and predictable. A tiny random model is enough to check that the plumbing works: that tokens flow from the worker to the gateway, that batching does not change the answers, that cancellation frees the slot, and that errors are reported in the right format. The text it writes will not make sense, but the numbers it produces can be checked against a simple reference implementation, and that is what a test needs.

Notes on the weather, the seasons and the sky

The morning began grey and still. A thin layer of cloud covered the whole sky, and the light was soft and flat, without shadows. By ten o'clock a light wind came up from the west and the clouds began to break. Patches of blue opened over the hills, and the sun came through in long bright bands that moved across the fields. In the afternoon the wind turned to the north and the air grew cold. Dark clouds gathered over the sea, and just before evening it started to rain.

Weather is the state of the air at a given place and time: the temperature, the pressure, the wind, the humidity, the clouds and the rain. Climate is the pattern of weather over many years. A single cold week in summer says little about the climate, but a slow change in the average temperature over decades says a great deal. Forecasters study both. They collect measurements from stations on land, from ships and buoys at sea, from balloons that rise through the atmosphere, and from satellites that watch the clouds from above.

A weather forecast is a prediction made by a computer model of the atmosphere. The model divides the air into a grid of boxes and calculates how heat, water and wind move from one box to the next. Small errors in the starting measurements grow over time, which is why a forecast for tomorrow is usually good, a forecast for next week is only a rough guide, and a forecast for next month is little more than an educated guess. To show how certain a forecast is, many centres run the model several times with slightly different starting values and compare the results.

Clouds form when moist air rises and cools. Cool air cannot hold as much water vapour as warm air, so some of the vapour condenses into tiny droplets or ice crystals. Low, flat clouds called stratus bring grey days and drizzle. Tall, heaped clouds called cumulus grow on warm afternoons, and when they grow very tall they become thunderstorm clouds, with heavy showers, lightning and sometimes hail. High, thin clouds called cirrus are made of ice and often arrive a day before a change in the weather.

Wind is air moving from high pressure to low pressure. Because the earth turns, the wind does not blow straight from one to the other but curves around the centres of pressure. In the northern half of the world the wind turns clockwise around high pressure and anticlockwise around low pressure. A deep area of low pressure brings strong winds, clouds and rain. A large area of high pressure brings calm, settled weather: warm sunny days in summer and cold, clear nights with frost in winter.

Spring arrives slowly in the north. First the days grow longer, then the snow begins to melt on the south side of the hills, and the rivers rise with the water from the mountains. Birds return from the south and start to sing before dawn. The first flowers open in the woods, and the trees put out small green leaves. A warm day in April can feel like summer, but a cold night can still bring frost, and gardeners know not to plant tender seedlings too early.

Summer is the season of long evenings. In the far north the sun barely sets in June, and the sky stays light all night. Thunderstorms build on hot afternoons, and a heavy shower can cool the air in a few minutes. Near the coast a sea breeze blows in from the water during the day, when the land is warmer than the sea, and a land breeze blows out at night. In dry years the grass turns brown, the rivers run low, and the risk of fire grows in the forests.

Autumn brings mist in the morning and bright, clear afternoons. The leaves change colour, from green to yellow, orange and red, and then they fall. Storms come in from the ocean, one after another, with strong winds and heavy rain. The first frost usually arrives in October or November, and the first snow falls on the mountains while the valleys are still green.

Winter is cold and dark in the north, but it has its own beauty. After a night of snow the world is quiet, and every branch is covered in white. On a clear, calm night the temperature can fall far below freezing, and in the morning the windows are covered with patterns of ice. In the cities, people wait for the bus in thick coats and hats, and the air smells of smoke and roasted chestnuts.

The weather report this evening: tonight will be cloudy with outbreaks of rain, heavy at times in the west. Winds will be fresh to strong from the south west, with gusts of up to sixty kilometres per hour on the coast. The lowest temperature will be eight degrees. Tomorrow will start wet, but the rain will clear to the east by midday, leaving sunny spells and a few showers. The highest temperature will be fourteen degrees. The outlook for the weekend is drier and brighter, with light winds and a chance of fog in the mornings.

People have always tried to read the sky. Sailors said that a red sky at night was a good sign and a red sky in the morning was a warning. Farmers watched the behaviour of animals, the shape of the clouds and the colour of the moon. Some of these sayings have a grain of truth in them, because the weather in many places tends to move from west to east, and a clear sky in the west at sunset often means that clear air is on its way. Others are no better than a guess.

Rain gauges, thermometers and barometers were the first instruments of weather science. A barometer measures the pressure of the air. When the pressure falls quickly, a storm is often coming; when it rises, the weather is likely to improve. A thermometer in a white box with open sides, placed well above the ground, measures the temperature of the air in the shade. A rain gauge is a simple funnel and a cylinder, read every morning at the same time. Long records from these instruments, kept carefully for more than a hundred years in some places, are the backbone of what we know about the climate.

In the kitchen: bread, soup and a few simple recipes

Good bread needs only four things: flour, water, salt and yeast. The rest is time and patience. Mix five hundred grams of strong white flour with ten grams of salt and seven grams of dried yeast. Add three hundred and fifty millilitres of warm water and stir until there is no dry flour left in the bowl. The dough will be sticky. Cover the bowl and leave it for half an hour, then fold the dough over itself a few times with wet hands. Repeat the folding three or four times during the next two hours. The dough will become smooth and strong, and it will rise to almost twice its size.

Shape the dough into a round loaf and place it on a floured cloth in a basket. Let it rise again for about an hour, or overnight in the fridge if you want a deeper flavour. Heat the oven to two hundred and forty degrees with a heavy pot inside. When the oven is hot, turn the loaf into the pot, cut a line across the top with a sharp knife, put the lid on and bake for twenty minutes. Then take the lid off, lower the heat a little and bake for another twenty to twenty-five minutes, until the crust is a deep golden brown and the loaf sounds hollow when you tap the bottom. Let it cool before you cut it, because the inside keeps cooking as it cools.

A simple vegetable soup is one of the most useful things a cook can know. Chop an onion, two carrots and two sticks of celery. Warm some olive oil in a large pan and cook the vegetables slowly for ten minutes, until they are soft and sweet but not brown. Add a clove of garlic, a few potatoes cut into small cubes, a tin of tomatoes and a litre of stock. Bring it to the boil, then turn the heat down and let it simmer for twenty minutes. At the end add a handful of green beans or peas, a little pasta or rice, and some chopped parsley. Taste it and add salt and pepper. It is better the next day.

Soup can be made from almost anything. In autumn, roast a squash with a little oil and salt until it is soft, then blend it with fried onion, stock and a spoon of cream. In winter, cook lentils with cumin, garlic and lemon. In summer, a cold soup of tomatoes, cucumber, peppers, bread, olive oil and vinegar, blended until smooth, is a fine lunch on a hot day. The Spanish call it gazpacho, and every family has its own recipe.

To cook rice well, rinse it first in cold water until the water runs clear. Use one and a half cups of water for every cup of rice. Bring the water to the boil with a pinch of salt, add the rice, cover the pan with a tight lid and turn the heat to very low. After twelve minutes turn the heat off and leave the pan closed for ten more minutes. Then open it and fluff the rice with a fork. Do not stir the rice while it cooks, or it will become sticky.

Pasta needs a large pot of water and plenty of salt. Cook it until it is tender but still firm to the bite, which the Italians call al dente. Save a cup of the cooking water before you drain it. A simple sauce can be made while the pasta cooks: warm olive oil with sliced garlic and a pinch of chilli, add the drained pasta, a splash of the cooking water and a handful of grated cheese, and toss everything together until the sauce is glossy. Add chopped parsley and a squeeze of lemon. It takes fifteen minutes from start to finish.

A good omelette is quick but needs attention. Beat three eggs with a pinch of salt. Heat a small pan over a medium flame and add a knob of butter. When the butter foams, pour in the eggs and stir them gently with a fork while shaking the pan, so that the eggs set in soft, small curds. When the eggs are almost set but still a little wet on top, stop stirring, add some cheese or herbs, fold the omelette in half and slide it onto a warm plate. The whole thing takes less than two minutes.

Baking a cake is more exact than cooking a soup, because the chemistry of flour, sugar, eggs and butter depends on the amounts. For a simple sponge, weigh the eggs in their shells and use the same weight of butter, sugar and flour. Beat the soft butter with the sugar until pale and light, add the eggs one at a time, then fold in the flour with a little baking powder. Bake in a moderate oven for about twenty-five minutes, until a thin skewer pushed into the middle comes out clean. Fill it with jam and cream, or simply dust the top with sugar.

Spices change a dish completely. Cumin, coriander and turmeric give warmth to lentils and vegetables. Paprika and smoked pepper go well with beans and potatoes. Cinnamon, cloves and nutmeg belong to cakes and winter drinks, but a pinch of cinnamon also works in a tomato sauce with lamb. Buy whole spices when you can, toast them briefly in a dry pan and grind them just before use; the flavour is much stronger than that of old ground spices from the back of the cupboard.

The café on the corner serves a crème brûlée that people travel across the city to taste, and a jalapeño cornbread that sells out before noon. The owner, who trained in Lyon and worked for years in a small restaurant in Zürich, says that the secret of good food is not a secret at all: buy good ingredients, cook them simply, and taste everything before it leaves the kitchen. Her menu changes with the seasons, and she writes it by hand on a board every morning.

A recipe is a kind of program. It lists the ingredients, which are the inputs, and the steps, which must be followed in order. Some steps can run at the same time, like boiling water while you chop the onions, and some must wait for others to finish, like resting the dough before it can be shaped. An experienced cook plans the order of the work so that everything is ready at the same moment, which is not so different from the way a scheduler plans the work of a computer.

Travel notes from trains, harbours and small hotels

The night train left the station a few minutes after ten. The compartment had four narrow beds, a small table under the window and a bottle of water for each passenger. Outside, the lights of the city slid past, then the suburbs, then dark fields and the occasional village with a single street lamp. The rhythm of the wheels on the rails was slow and regular, and after an hour it was easy to fall asleep. In the morning the train was running along a wide river between steep hills covered in vineyards, and the conductor came round with coffee and bread.

Travelling by train is slower than flying, but you see the country change outside the window. The houses change their shape and colour, the fields change their crops, and the language on the station signs changes from one border to the next. In München the signs say Hauptbahnhof, in Zürich they are written in German, French and Italian, and in Malmö the announcements are in Swedish and English. On the long line to Kraków the train stops at small stations where a few people get on with bags of apples and bread.

Lisbon is a city of hills, trams and tiled walls. The old yellow trams climb streets so steep that the houses seem to lean over them. In the evening people gather at the viewpoints to watch the sun go down over the river, and from the small bars comes the sound of fado, a sad and beautiful kind of song. Further away, in São Paulo, the city never seems to sleep: traffic, music and food stalls fill the streets late into the night, and the markets sell fruits that most Europeans have never seen.

In Tokyo, which the Japanese write as 東京, the trains run exactly on time. A delay of a minute is announced with an apology. The stations are enormous, with hundreds of shops below the ground, and yet everything is clean and calm. Outside the centre there are quiet streets with small wooden houses, tiny gardens and shrines where people stop for a moment on their way to work. A bowl of noodles at a counter near the station costs less than a sandwich in many European cities, and it is often better.

Good travel is mostly about small things. A comfortable pair of shoes. A light bag that you can carry up stairs. A notebook for addresses and the names of places you want to remember. A few words of the local language: hello, please, thank you, excuse me, how much is this, where is the station. People are almost always kind to a visitor who tries to speak their language, even badly. A smile and a little patience go a long way.

The hotel was small, with only eight rooms, and it stood at the end of a narrow street near the harbour. The owner, an old man with a white beard, carried the bags upstairs himself and insisted on showing every guest the view from the roof. From there you could see the whole bay: the fishing boats coming in, the ferry leaving for the islands, and the lighthouse on the point. Breakfast was served on the terrace: fresh bread, honey, yoghurt, figs and very strong coffee.

Maps have changed the way we travel. A paper map shows you the whole area at once, so you learn where things are in relation to each other. A phone shows you only the next turn, which is easier but teaches you less. Many travellers now carry both: the phone for the details and a paper map for the big picture. In the mountains, where the signal is weak and the batteries drain quickly in the cold, a paper map and a compass are still the safest choice.

The ferry to the island took three hours. The sea was calm at first, a deep blue with small white waves, but halfway across the wind picked up and the boat began to roll. Some passengers went inside and sat very still with their eyes closed; others stood at the rail and watched the dolphins that followed the boat for a while. When the island came into view, with its white houses and its church on the hill, everyone came back out on deck to look.

A naïve traveller believes that the best places are the famous ones. The experienced traveller knows that the best moments are usually unplanned: a conversation with a stranger on a bus, a village festival found by chance, a storm that forces you to spend an afternoon in a small museum you would never have visited. Leave some space in your plans for the unexpected. The résumé of a good journey is rarely the list of things you planned to see.

The lighthouse keeper and the clock

There was once a lighthouse on a rock at the edge of the sea, and in the lighthouse lived a keeper named Tomas. Every evening at sunset he climbed the one hundred and twelve steps to the lamp room, lit the great lamp, and wound the clock that turned the lens. Every morning at sunrise he climbed the steps again, put out the lamp, cleaned the glass and wrote in the log book: the time, the weather, the ships that had passed in the night.

The clock was older than the lighthouse itself. It had been made by a clockmaker in a town far inland, a man who had never seen the sea. The clockmaker had built it to turn the lens once every thirty seconds, exactly, so that sailors could tell this light from every other light on the coast. Tomas wound it with a heavy brass key, forty turns every evening, and he oiled its wheels once a month with a small can of oil that he kept in a drawer of his desk.

One winter night, during the worst storm that anyone could remember, the clock stopped. The wind was howling around the tower, the rain was hammering on the windows, and the waves were breaking so high that the spray reached the lamp room. Tomas heard the ticking stop and ran up the stairs. The lens was still. Far out at sea, he could see the lights of a ship, moving slowly toward the rocks.

He knew that a light that did not turn was worse than no light at all, because a sailor who saw a steady light would think it was a different lighthouse, many miles away, and would steer the wrong course. So Tomas put his shoulder against the frame of the lens and began to push it round by hand. He counted the seconds under his breath, one turn every thirty seconds, over and over, all through the night. His arms ached, his legs shook, and more than once he thought he could not go on. But he kept counting and he kept pushing.

At dawn the storm passed. The ship had turned away from the rocks in the night and was safely anchored in the bay. Its captain came ashore in a small boat and climbed the steps of the lighthouse to thank the keeper. He found Tomas asleep on the floor of the lamp room, with his hand still resting on the frame of the lens.

Later, when Tomas opened the clock, he found the cause of the trouble: a small piece of sand, carried in by the wind, had jammed between two of the wheels. He cleaned it out, oiled the wheels, and wound the clock again. It ran for another forty years without stopping once. But from that night on, Tomas kept a small notebook beside the clock, and in it he wrote down the number of seconds in every turn, checked against his own pocket watch, every evening before he went to bed.

When Tomas grew old, a young woman named Ana came to take his place. He showed her the steps, the lamp, the clock and the log book. He showed her how to wind the clock, forty turns, and how to oil the wheels. Then he gave her the small notebook. She asked him why he had written down the same number every night for forty years. He smiled and said that the most important thing about a light is not that it is bright, but that it keeps its rhythm, so that the people who depend on it always know where they are.

Code, commands and configuration

A small HTTP server in TypeScript:

import { serve } from '@hono/node-server';
import { Hono } from 'hono';

const app = new Hono();
app.get('/health', (c) => c.json({ status: 'ok' }));
app.post('/v1/chat/completions', async (c) => {
  const body = await c.req.json();
  if (!Array.isArray(body.messages)) {
    return c.json({ error: { message: 'messages must be an array', type: 'invalid_request_error' } }, 400);
  }
  return c.json({ id: 'chatcmpl-123', object: 'chat.completion', choices: [] });
});
serve({ fetch: app.fetch, port: 8080 });

A function that returns the index of the largest value in an array:

export function argmax(values: Float32Array): number {
  let best = 0;
  for (let i = 1; i < values.length; i++) {
    if (values[i] > values[best]) best = i;
  }
  return best;
}

A loop that streams tokens until the model stops:

for await (const step of engine.generate(request, signal)) {
  if (step.text.length > 0) writer.write('data: ' + JSON.stringify(step) + '\n\n');
  if (step.finishReason !== undefined) break;
}

Python code for the same idea:

def generate(model, tokenizer, prompt, max_new_tokens=20):
    ids = tokenizer.encode(prompt)
    for _ in range(max_new_tokens):
        logits = model(ids)
        next_id = int(logits[-1].argmax())
        if next_id == tokenizer.eos_token_id:
            break
        ids.append(next_id)
    return tokenizer.decode(ids)

Shell commands that you type every day:

npm install
npm run build
npm test -- --watch
git status
git add src/index.ts && git commit -m "Fix the stream parser"
git log --oneline | head -20
curl -N http://localhost:8080/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "tiny", "stream": true, "messages": [{"role": "user", "content": "Hello"}]}'
redis-server --port 6380 --save '' --appendonly no
docker compose up --build
ls -la /var/log/nginx
tail -f server.log | grep error

A configuration file in JSON:

{
  "name": "sluice",
  "version": "1.0.0",
  "private": true,
  "scripts": { "build": "tsc -p tsconfig.json", "test": "vitest run" },
  "dependencies": { "zod": "^4.0.0" }
}

A YAML file for a service:

services:
  redis:
    image: redis:7
    ports:
      - "6379:6379"
  gateway:
    build: .
    environment:
      REDIS_URL: redis://redis:6379
      PORT: 8080
    depends_on:
      - redis

A query in SQL:

SELECT user_id, COUNT(*) AS requests, SUM(completion_tokens) AS tokens
FROM usage
WHERE created_at >= '2024-01-01'
GROUP BY user_id
ORDER BY tokens DESC
LIMIT 10;

Error messages you may see:

Error: connect ECONNREFUSED 127.0.0.1:6379
TypeError: Cannot read properties of undefined (reading 'length')
SyntaxError: Unexpected token } in JSON at position 42
RangeError: Maximum call stack size exceeded
HTTP 429 Too Many Requests: the server is overloaded, please retry later
HTTP 400 Bad Request: max_tokens must be a positive integer

When a test fails, read the first error, not the last one. The first error is usually the cause, and the others are often only its consequences. Run the failing test on its own, add a log line before the place where it breaks, and check your assumptions one at a time. Most bugs are simple once you find them: a missing await, an index that is off by one, a value that is null when you expected a string, or a timer that is never cleared.

Good code is easy to read. Choose names that say what a thing is, not how it is built. Keep functions short and give each one a single job. Write a comment when the reason for a choice is not obvious from the code, and delete comments that only repeat what the code says. Write tests that describe behaviour in plain sentences, like "returns an error when the queue is full" or "keeps the first token when the client reconnects". A test that fails should tell you what went wrong without reading its source.

const config = {
  port: Number(process.env.PORT ?? 8080),
  redisUrl: process.env.REDIS_URL ?? 'redis://127.0.0.1:6379',
  maxBatchSize: 32,
  maxQueueLength: 1000,
  requestTimeoutMs: 60_000,
};

interface Message {
  role: 'system' | 'user' | 'assistant';
  content: string;
}

class RateLimiter {
  private tokens: number;
  constructor(private readonly capacity: number, private readonly refillPerSecond: number) {
    this.tokens = capacity;
  }
  tryTake(): boolean {
    if (this.tokens < 1) return false;
    this.tokens -= 1;
    return true;
  }
}

A year in a small garden

The garden behind the house is not large: a strip of grass, a few beds of vegetables, an old apple tree and a wooden shed at the far end. But it changes every week of the year, and there is always something to do in it. In January the work is mostly planning. On a cold evening, with a cup of tea and a pile of seed catalogues, it is pleasant to decide what to grow in the coming season and where each plant will go.

In February and March the first seeds are sown indoors, on a sunny window sill: tomatoes, peppers and a few flowers. The seedlings need light, warmth and a little water, but not too much, or their roots will rot. Outside, the soil is prepared for spring. Old leaves are raked away, the beds are covered with a layer of compost, and the earth is left to warm up in the sun. Worms pull the compost down into the soil and do most of the digging for you.

April is the month of potatoes, peas and onions. Potatoes go into a trench about a hand deep, with their shoots pointing up. Peas need something to climb on, so a row of sticks or a net goes in beside them. Onions are pushed gently into the soil, with their tips just showing. Birds like to pull them out again, so a light net over the bed helps for the first few weeks. On a warm afternoon the bees are already busy in the apple blossom.

By May the garden is full of green. The lettuce grows quickly, and the first leaves can be picked for a salad. The tomato plants are moved outside after the last frost, into a sheltered place against the south wall. Weeds grow just as fast as the vegetables, and an hour of weeding every week keeps them under control. It is easier to pull them when they are small and the soil is damp after rain.

Summer brings the harvest. Beans, courgettes and tomatoes all ripen at once, and there are more than one family can eat. The neighbours receive bags of vegetables, and the kitchen smells of sauces and pickles. Watering becomes the main job in dry weeks: early in the morning or late in the evening, so that the water soaks into the ground instead of drying in the sun. A barrel that collects rain from the roof of the shed saves a lot of walking with the watering can.

In September the apples are ready. Some are eaten straight from the tree, some are stored in boxes in the cool shed, and some become apple cake, apple sauce or juice. The last tomatoes are picked green and left to ripen on the window sill. Garlic is planted for next year, and the empty beds are sown with a green crop that will protect the soil through the winter and feed it when it is dug in.

Winter is quiet in the garden. The beds rest under their covers, the apple tree is bare, and the birds come to the feeder for seeds and fat. It is the time to repair tools, clean pots, prune the fruit trees and dream about next year. Every gardener makes the same promise in winter: next year the garden will be tidier, the rows will be straighter, and the weeds will never get out of hand. Every gardener breaks that promise by June, and nobody minds.

Letters, printing and the long history of sending words

For most of human history, a message could travel no faster than a person, a horse or a ship. A letter from one end of a large country to the other could take weeks, and a letter across the ocean could take months. Merchants, kings and families all depended on couriers who carried bags of letters along roads that were often dangerous and sometimes impassable. The first postal services were built by governments for their own use, and only later opened to ordinary people.

Printing changed the speed at which ideas could spread. Before the printing press, every book had to be copied by hand, which took months and made books rare and expensive. With movable type, a printer could set a page once and print hundreds of copies. Within a few decades there were printing shops in most large towns of Europe, and pamphlets, calendars, news sheets and books were sold at markets and fairs. People who had never owned a book could now buy one, and many learned to read because there was suddenly so much to read.

The telegraph was the next great change. For the first time, a message could travel faster than any messenger. Wires were strung along railway lines and then across the floor of the ocean, and operators tapped out messages in a code of short and long signals. A message that had taken weeks now took minutes. Newspapers printed reports from distant cities on the same day, and markets in different countries began to move together. Sending a telegram was expensive, so people wrote as few words as possible, and a style of short, clipped sentences was born.

The telephone let people speak to each other across great distances, and radio let one voice reach millions at once. Each new medium changed not only how fast words could travel but also how people wrote and spoke. A letter could be long and careful; a telegram had to be short; a telephone call was a conversation, with all its pauses and interruptions; a radio broadcast had to be clear enough to follow without pictures.

Today a message can cross the world in less than a second, and we send so many of them that the hard problem is no longer speed but attention. A chat application shows words as they are typed, a news site updates while you read it, and a language model streams its answer one piece at a time. In a sense the streaming answer is a return to the oldest form of communication, the spoken word, which also arrives one piece at a time and can be interrupted at any moment.

Libraries and archives keep the record of all these messages. An old letter can tell a historian what people ate, how much they paid for bread, what they feared and what they hoped for. A printed timetable shows how long a journey took, and a telegram from a ship shows how news of a storm reached the shore. The quiet work of librarians and archivists, who catalogue and protect these papers, makes it possible for later generations to understand the past.

Some words on languages and scripts. English is written with the Latin alphabet, like French, Spanish, German and many others, but each of these adds its own marks: the French write café and garçon, the Germans write Straße and Mädchen, the Spanish write mañana and niño. Greek uses its own alphabet, and the Greek name of Greece is Ελλάδα. Russian uses Cyrillic letters, and a friendly greeting is Привет. Japanese mixes three scripts, and the word for the Japanese language is 日本語. Chinese uses thousands of characters, and the word for the Chinese language is 中文. Arabic is written from right to left, and a common greeting is مرحبا. Modern computers store all of these with one standard, Unicode, usually in the UTF-8 encoding, in which a Latin letter takes one byte and a Chinese character takes three. Even small pictures such as 🙂, 🚀 and ☕ have their own codes.

Questions and answers

Question: What is the capital of France?
Answer: The capital of France is Paris.

Question: How many days are there in a leap year?
Answer: A leap year has 366 days. The extra day is the 29th of February.

Question: Can you explain what a queue is in simple words?
Answer: A queue is a line of things waiting to be handled. The first thing that joins the line is the first thing that leaves it, like people waiting at a bus stop. In software, a queue holds jobs until a worker is free to process them.

Question: Why is my program so slow?
Answer: It is hard to say without more details. Start by measuring where the time goes. Often a program is slow because it does the same work many times, waits for the network one request at a time, or reads a large file into memory when it only needs a small part of it. Fix the biggest problem first and measure again.

Question: What should I cook for dinner tonight?
Answer: If you have eggs, cheese and a few vegetables, an omelette with a green salad is quick and good. If you have more time, a pot of soup or a simple pasta with garlic, olive oil and lemon is hard to beat.

Question: Will it rain tomorrow?
Answer: I cannot see the sky from here, so please check a local weather forecast. If the pressure is falling and the wind is turning to the south west, rain is likely.

Question: Tell me a short story about a cat.
Answer: Once upon a time there was a small grey cat who lived in a bookshop. Every morning she sat in the window and watched the people walk by. Every evening, when the shop was closed, she walked along the shelves and chose one book to sleep on. The owner never knew why the cat chose the books she did, but he noticed that the books she slept on were always sold the next day.

Question: How do I say thank you in other languages?
Answer: In French you say merci, in Spanish gracias, in German danke, in Italian grazie, in Portuguese obrigado, in Japanese arigatou, and in Swedish tack.

Question: What is the difference between a process and a thread?
Answer: A process is a running program with its own memory. A thread is a line of execution inside a process; several threads share the same memory. Threads are lighter to create, but because they share memory they must be careful not to change the same data at the same time.

Question: Why does the sky look blue?
Answer: Sunlight contains all colours. When it passes through the air, the short blue waves are scattered in every direction much more than the long red ones, so blue light reaches our eyes from every part of the sky. At sunset the light travels through more air, most of the blue is scattered away, and the sky turns orange and red.

Question: What is a good way to learn a new language?
Answer: Practise a little every day rather than a lot once a week. Listen to the language as much as you can, read simple texts that interest you, learn the most common words first, and do not be afraid to make mistakes when you speak. Mistakes are how everyone learns.

Question: How long should I boil an egg?
Answer: For a soft egg with a runny yolk, put it into boiling water for about six minutes. For a firm yolk, boil it for nine or ten minutes, then cool it in cold water so that it is easy to peel.

Question: Is it better to walk or to take the bus?
Answer: If the distance is short and the weather is good, walking is healthy, cheap and often just as fast. If it is raining, you are carrying heavy bags or you are in a hurry, the bus is the better choice.

Question: What numbers come after ten?
Answer: Eleven, twelve, thirteen, fourteen, fifteen, sixteen, seventeen, eighteen, nineteen and twenty. Then twenty-one, twenty-two, and so on up to one hundred. In digits: 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 100, 1000, 2024, 3.14, 0.5 and 99%.

Notes from a workshop on measuring performance

Benchmarks are experiments, and like every experiment they can mislead you if you are not careful. The first rule is to measure the thing you care about. If users care about how quickly the first words appear, measure the time to first token, not only the total throughput. If they care about the cost of a long report, measure the tokens per second of a single long answer. A benchmark that reports one impressive number without saying what was measured, on which machine, with which settings, is not worth much.

The second rule is to repeat the measurement. A shared machine is noisy: other programs wake up, the processor changes its clock speed, the operating system moves threads from one core to another. Run each case several times, report the median, and look at the spread. If two versions of a program differ by two percent and the spread is ten percent, you have learned nothing. Compare versions side by side in the same run, on the same machine, so that the noise affects both of them equally.

The third rule is to warm up. The first request after a restart is often slow: files are read from disk, caches are empty, the runtime compiles code for the first time, and memory is allocated. Unless the cold start is what you want to measure, send a few requests first and throw their timings away.

Latency and throughput are related but different. Latency is how long one request takes; throughput is how many requests, or tokens, the system handles per second. Batching usually raises throughput and raises latency a little, because each step does more work. A good server lets the operator choose the balance, for example with a limit on the number of sequences in a batch or on the number of tokens in one step.

Percentiles describe latency better than averages. The average hides the slow requests, and the slow requests are the ones users remember. The median, or fiftieth percentile, tells you what a typical request sees; the ninety-ninth percentile tells you what one request in a hundred sees. When the load grows close to the capacity of the system, the tail grows much faster than the median, because requests start to wait in the queue behind each other.

Profilers show where the time goes. A flame graph draws every function as a bar whose width is the time spent in it, stacked on top of the function that called it. Wide bars near the top are the hot spots. In a model server the hot spots are usually the matrix products of the model itself, which is good news, because it means the rest of the system is not in the way. If the hot spots are in JSON parsing, logging, or copying buffers, there is easy work to be done.

Memory leaks show up slowly. A server that runs well for an hour may fail after a day because every request leaves a little memory behind: a listener that is never removed, a map that only grows, a timer that holds a closure. Watch the memory of a long test run, not just its speed, and make sure it levels off. A heap snapshot taken before and after a thousand requests shows which objects are piling up.

Load tests should look like real traffic. Real users do not send requests at perfectly regular intervals; they arrive in bursts, ask short and long questions, and sometimes give up and close the connection halfway through an answer. A load generator that draws arrival times from a random distribution, mixes prompt lengths, and cancels a share of its requests will find problems that a simple loop never finds.

Finally, write down what you did. A short report with the machine, the versions, the settings, the commands and the raw numbers is worth more than a beautiful chart without them. Six months later, when someone asks why a setting has the value it has, that report is the answer.

Sports and games have their own kind of measurement. A runner times every lap, a cyclist watches the power meter, a swimmer counts strokes per length, and a chess player notes how long each move took. Football teams count passes, shots and distances run; tennis players look at the speed of their serve and the share of first serves that land in. Athletes learn the same lesson as engineers: the numbers only help if you know what question you are asking, and if you measure the same way every time.
`;
