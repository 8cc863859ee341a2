// A real OpenAI client against a kvxfer router: node client.mjs BASE_URL
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "unused" });

const c = await client.completions.create({ model: "tiny-gqa", prompt: "Hello", max_tokens: 8, temperature: 0 });
if (!c.choices?.length || typeof c.choices[0].text !== "string" || c.choices[0].text.length === 0) {
  throw new Error("empty completion: " + JSON.stringify(c));
}
console.log("completion ok:", JSON.stringify(c.choices[0].text), c.usage?.completion_tokens, "tokens");

let text = "";
let chunks = 0;
const stream = await client.completions.create({ model: "tiny-gqa", prompt: "Hello", max_tokens: 8, temperature: 0, stream: true });
for await (const chunk of stream) {
  chunks++;
  text += chunk.choices?.[0]?.text ?? "";
}
if (chunks < 2 || text !== c.choices[0].text) {
  throw new Error(`stream: ${chunks} chunks, text ${JSON.stringify(text)} != ${JSON.stringify(c.choices[0].text)}`);
}
console.log("stream ok:", chunks, "chunks");

const chat = await client.chat.completions.create({ model: "tiny-gqa", messages: [{ role: "user", content: "Hi" }], max_tokens: 6 });
if (typeof chat.choices?.[0]?.message?.content !== "string") {
  throw new Error("chat: " + JSON.stringify(chat));
}
console.log("chat ok:", JSON.stringify(chat.choices[0].message.content));
