"""The prefix index's Redis format: per block, a bitmap of the entries holding it, and the scripts that keep it.

Each entry (one worker process's cache, `WorkerState.cache_key`) is given a small integer slot; `BLOCKS_KEY` maps
each block hash to a bitmap of the slots holding it, so a match reads the prompt's blocks once, whatever the number
of workers (before, it looked up each holder's probe: ~8 ms of Redis a request where 128 prefill workers all held a
shared system prompt). Each entry also keeps its sorted set of blocks (`entry_key`), scored as before: placements by
time, the worker's own keys from `CACHED` up; it says what to trim and which bits to clear when the entry goes.

Every write keeps both in one script: a block is in an entry's set exactly when its bit is set. An entry that goes
(its worker left, its lease ran out, a whole copy replaced it) moves its set aside (`freeing:<slot>`), and writers
walk those sets a chunk at a time (`sweep`, run by writes, at most every SWEEP_EVERY_MS across the fleet) clearing
their bits; only then is the slot free again, so a reused slot never inherits a former owner's bits. `SLOTS_KEY`
holds the mappings (cache key -> "slot:lease end") and the slots' bookkeeping; its fields of bookkeeping start with
a NUL byte, which no cache key does. Its version moves on every change of a mapping (a slot given out, or put aside),
so routers keep the slots they read while it holds, and a match given slots of another version answers "stale"
instead of reading a slot put aside, or reused, as its former owner's. Both hashes carry one epoch: one lost alone
(deleted by hand, or left to its backstop TTL) resets the index, as a Redis restarted empty would, and the workers
copy their caches again.
"""

from __future__ import annotations

from pdserve.registry.base import PREFIX_TTL_S
from pdserve.registry.redis import PREFIX

NAMESPACE = f"{PREFIX}:prefix_index"  # apart from the build before's `pdserve:prefix:*`: neither reads the other's
SLOTS_KEY = f"{NAMESPACE}:slots"
VERSION_FIELD = b"\0version"  # SLOTS_KEY's count of mapping changes: a router's cached slots hold while it does
BLOCKS_KEY = f"{NAMESPACE}:blocks"
KEYS = [SLOTS_KEY, BLOCKS_KEY]
CACHED = 1e12  # added to a worker's own keys' scores: above any placement's (a Unix time)
WHOLE_MARK = b"whole"  # a member no 16-byte block hash equals: the entry holds a whole copy and what followed
BACKSTOP_S = 2 * PREFIX_TTL_S  # every key's TTL, refreshed by its writes: an index nobody writes goes in the end
SWEEP_EVERY_MS = 100  # a step of the sweep, across the whole fleet
WALK_CHUNK = 2048  # blocks of a freed entry whose bits one step clears: a few ms of Redis


def entry_key(cache_key: str) -> str:
    return f"{NAMESPACE}:entry:{cache_key}"


_PRELUDE = r"""
local SLOTS, BLOCKS = KEYS[1], KEYS[2]
local NS, MARK, CACHED, VERSION = '@NS@', '@MARK@', '@CACHED@', '\0version'
local LEASE, BACKSTOP, SWEEP_MS, WALK = @LEASE@, @BACKSTOP@, @SWEEP_MS@, @WALK@
local BATCH = 1000  -- arguments a command is given at once (Lua's unpack takes ~8000)

local function now() return tonumber(redis.call('TIME')[1]) end
local function entry_key(key) return NS .. ':entry:' .. key end
local function freeing_key(slot) return NS .. ':freeing:' .. slot end
local function slot_in(value) return value and tonumber(string.match(value, '^(%d+):')) end

local function slots(field)
  local out = {}
  for s in string.gmatch(redis.call('HGET', SLOTS, field) or '', '%d+') do out[#out + 1] = tonumber(s) end
  return out
end
local function save(field, list) redis.call('HSET', SLOTS, field, table.concat(list, ',')) end

local function reset(why)
  redis.call('UNLINK', SLOTS, BLOCKS)
  local t = redis.call('TIME')
  -- the version starts at the time in µs: above any a router read before the reset
  redis.call('HSET', SLOTS, '\0epoch', t[1] .. '.' .. t[2], '\0next', 0, VERSION, t[1] .. string.format('%06d', t[2]))
  redis.call('HSET', BLOCKS, '\0epoch', t[1] .. '.' .. t[2])
  redis.log(redis.LOG_WARNING, 'pdserve prefix index reset: ' .. why)
end
-- A slot whose blocks are unknown: the index starts afresh, and this write fails (the worker copies its cache again).
local function inconsistent(why) reset(why); error('pdserve prefix index reset: ' .. why) end
local function consistent()
  local a, b = redis.pcall('HGET', SLOTS, '\0epoch'), redis.pcall('HGET', BLOCKS, '\0epoch')
  if type(a) ~= 'string' or a ~= b then reset('its two halves disagree (one lost, or a first write)') end
end

local function take_slot()  -- the lowest free: bitmaps stay as short as the fleet is large
  local free = slots('\0free')
  if #free == 0 then return redis.call('HINCRBY', SLOTS, '\0next', 1) - 1 end
  local slot = table.remove(free, 1)
  save('\0free', free)
  return slot
end

-- A mapping changed (a key given a slot, or its slot put aside): routers' cached mappings no longer hold.
local function moved() redis.call('HINCRBY', SLOTS, VERSION, 1) end
local function map(key, slot) redis.call('HSET', SLOTS, key, slot .. ':' .. (now() + LEASE)) end
local function refresh(ekey)
  redis.call('EXPIRE', ekey, BACKSTOP)
  redis.call('EXPIRE', SLOTS, BACKSTOP)
  redis.call('EXPIRE', BLOCKS, BACKSTOP)
end

-- Sets (on) or clears `slot`'s bit in each member's bitmap; a bitmap left all zero goes.
local function set_bits(slot, members, on)
  local at, bitv = math.floor(slot / 8) + 1, bit.lshift(1, slot % 8)
  for i = 1, #members, BATCH do
    local part = {unpack(members, i, math.min(i + BATCH - 1, #members))}
    local maps = redis.call('HMGET', BLOCKS, unpack(part))
    local sets, dels = {}, {}
    for j, member in ipairs(part) do
      local v = maps[j] or ''
      local b = string.byte(v, at) or 0
      if (bit.band(b, bitv) ~= 0) ~= on then
        if on then
          v = v .. string.rep('\0', at - #v)
          b = bit.bor(b, bitv)
        else
          b = bit.band(b, bit.bnot(bitv))
        end
        v = string.sub(v, 1, at - 1) .. string.char(b) .. string.sub(v, at + 1)
        if not on then v = (string.gsub(v, '%z+$', '')) end
        if v == '' then dels[#dels + 1] = member else sets[#sets + 1] = member; sets[#sets + 1] = v end
      end
    end
    if #sets > 0 then redis.call('HSET', BLOCKS, unpack(sets)) end
    if #dels > 0 then redis.call('HDEL', BLOCKS, unpack(dels)) end
  end
end

local function remove(ekey, members)
  for i = 1, #members, BATCH do redis.call('ZREM', ekey, unpack(members, i, math.min(i + BATCH - 1, #members))) end
end

-- The entry goes: its set is put aside for the sweep to clear its bits, then its slot is free.
local function retire(key)
  local value = redis.call('HGET', SLOTS, key)
  if not value then return end
  local slot = slot_in(value)
  if not slot then inconsistent('entry ' .. key .. ' maps to ' .. value) end
  redis.call('HDEL', SLOTS, key)
  moved()
  local ekey, fkey = entry_key(key), freeing_key(slot)
  if redis.call('TYPE', ekey).ok ~= 'zset' then inconsistent('entry ' .. key .. ' lost its set') end
  redis.call('RENAME', ekey, fkey)
  redis.call('ZADD', fkey, '+inf', 'freeing')  -- its set exists until walked whole, however few blocks it held
  redis.call('EXPIRE', fkey, BACKSTOP)
  local freeing = slots('\0freeing')
  freeing[#freeing + 1] = slot
  save('\0freeing', freeing)
end

-- One step: entries whose lease ran out are retired, and up to WALK blocks of the first one put aside are cleared.
-- Returns 1 while more is put aside. `force`: whatever step the fleet took last (tests, and a process leaving).
local function sweep(force)
  if not force and not redis.call('SET', NS .. ':sweep', '1', 'NX', 'PX', SWEEP_MS) then return 0 end
  local t, all = now(), redis.call('HGETALL', SLOTS)
  for i = 1, #all, 2 do
    if string.byte(all[i], 1) ~= 0 and (tonumber(string.match(all[i + 1], ':(%d+)$')) or 0) < t then
      retire(all[i])
    end
  end
  local freeing = slots('\0freeing')
  local slot = freeing[1]
  if not slot then return 0 end
  local fkey = freeing_key(slot)
  if redis.call('TYPE', fkey).ok ~= 'zset' then inconsistent('slot ' .. slot .. ' lost its set mid-way') end
  local members = redis.call('ZRANGEBYSCORE', fkey, '-inf', '(+inf', 'LIMIT', 0, WALK)
  set_bits(slot, members, false)
  remove(fkey, members)
  if #members == WALK then return 1 end
  redis.call('DEL', fkey)
  table.remove(freeing, 1)
  save('\0freeing', freeing)
  local free = slots('\0free')
  local at = 1
  while free[at] and free[at] < slot do at = at + 1 end
  table.insert(free, at, slot)
  save('\0free', free)
  return #freeing > 0 and 1 or 0
end

local function args_from(first, last)  -- a table of ARGV's, without unpack's limit
  local out = {}
  for i = first, last or #ARGV do out[#out + 1] = ARGV[i] end
  return out
end
"""

# Each slot's run of leading probe blocks, or "stale" when a mapping changed since the slots were read (a slot given
# out, or put aside to be swept and reused: read as it was, it could be another entry's). ARGV: the mappings' version
# the router read the slots at, the number of slots, the slots, the probe. The bitmaps are read 64 at a time and
# ANDed, block by block, over the asked slots only (a slot no one asked for never keeps the walk going), until none
# is left: a match costs what its hit blocks are.
MATCH = r"""
if (redis.call('HGET', SLOTS, VERSION) or '') ~= ARGV[1] then return 'stale' end
local n = tonumber(ARGV[2])
local active, ended = {}, {}
for k = 1, n do
  local slot = tonumber(ARGV[k + 2])
  local at = math.floor(slot / 8) + 1
  active[at] = bit.bor(active[at] or 0, bit.lshift(1, slot % 8))
end
local first, total, done = n + 3, #ARGV - n - 2, 0
while next(active) and done < total do
  local last = math.min(done + 64, total)
  local maps = redis.call('HMGET', BLOCKS, unpack(ARGV, first + done, first - 1 + last))
  for j = 1, #maps do
    local v = maps[j] or ''
    for at, cur in pairs(active) do
      local kept = bit.band(cur, string.byte(v, at) or 0)
      if kept ~= cur then
        local gone = bit.band(cur, bit.bnot(kept))
        for b = 0, 7 do
          if bit.band(gone, bit.lshift(1, b)) ~= 0 then ended[(at - 1) * 8 + b] = done + j - 1 end
        end
        active[at] = kept ~= 0 and kept or nil
      end
    end
    if not next(active) then break end
  end
  done = last
end
local runs = {}
for k = 1, n do runs[k] = ended[tonumber(ARGV[k + 2])] or total end
return runs
"""

# A router's placement. ARGV: the cache key, the placements an entry keeps, then the blocks, scored by Redis's
# `TIME` (formatted with %.6f: Lua's tostring would round a Unix time to 10 us). Never lowers a cached block's score
# (GT); trims the oldest placements past the limit, never what the worker says it caches (scored from CACHED up).
RECORD = r"""
consistent()
local key, keep = ARGV[1], tonumber(ARGV[2])
local ekey, value = entry_key(key), redis.call('HGET', SLOTS, key)
local slot = slot_in(value)
if value and not slot then inconsistent('entry ' .. key .. ' maps to ' .. value) end
if not slot then
  slot = take_slot()
  moved()
  redis.call('DEL', ekey)  -- a set left from before a reset: none of it is indexed
end
-- Scored on Redis's clock, the leading blocks highest, so trimming drops a prompt's tail before its shared head.
local t = redis.call('TIME')
local now, members, pairs_ = tonumber(t[1]) + tonumber(t[2]) / 1e6, args_from(3), {}
for i, member in ipairs(members) do
  pairs_[#pairs_ + 1] = string.format('%.6f', now - (i - 1) * 1e-6)
  pairs_[#pairs_ + 1] = member
end
for i = 1, #pairs_, 2 * BATCH do
  redis.call('ZADD', ekey, 'GT', unpack(pairs_, i, math.min(i + 2 * BATCH - 1, #pairs_)))
end
set_bits(slot, members, true)
local over = redis.call('ZCOUNT', ekey, '-inf', '(' .. CACHED) - keep
if over > 0 then
  local gone = redis.call('ZRANGE', ekey, 0, over - 1)
  remove(ekey, gone)
  set_bits(slot, gone, false)
end
map(key, slot)
refresh(ekey)
sweep(false)
return over
"""

# A worker's journal. ARGV: the cache key, its keys' score, the number removed, the removed, the stored. Returns
# {1, the worker's own keys the entry holds}, or {0, 0} when the entry was lost since its last whole copy (the next
# take must be whole).
APPLY = r"""
consistent()
local key, score, n_removed = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ekey, value = entry_key(key), redis.call('HGET', SLOTS, key)
local slot = slot_in(value)
if value and not slot then inconsistent('entry ' .. key .. ' maps to ' .. value) end
if slot and redis.call('EXISTS', ekey) == 0 then
  reset('entry ' .. key .. ' lost its set')
  slot = nil
end
if not slot or not redis.call('ZSCORE', ekey, MARK) then
  sweep(false)
  return {0, 0}
end
local removed, stored = args_from(4, 3 + n_removed), args_from(4 + n_removed)
remove(ekey, removed)
set_bits(slot, removed, false)
for i = 1, #stored, BATCH do
  local part = {}
  for j = i, math.min(i + BATCH - 1, #stored) do part[#part + 1] = score; part[#part + 1] = stored[j] end
  redis.call('ZADD', ekey, unpack(part))
end
set_bits(slot, stored, true)
map(key, slot)
refresh(ekey)
local held = redis.call('ZCOUNT', ekey, CACHED, '+inf') - 1
sweep(false)
return {1, held}
"""

# A whole copy's start: a fresh slot for `<key>:staging` (a copy cut short before goes). ARGV: the cache key, 1 on
# the process's first take, when its worker id's other processes' entries go too (they cache nothing now).
STAGE = r"""
consistent()
local key = ARGV[1]
local staging = key .. ':staging'
local worker = string.match(key, '^[^/]*/')
if ARGV[2] == '1' and worker then
  for _, other in ipairs(redis.call('HKEYS', SLOTS)) do
    if string.sub(other, 1, #worker) == worker and other ~= key and other ~= staging then retire(other) end
  end
end
retire(staging)
local slot = take_slot()
redis.call('DEL', entry_key(staging))
map(staging, slot)
refresh(entry_key(staging))
return slot
"""

# A chunk of the whole copy, aside. ARGV: the staging key, the score, the blocks.
STAGE_MORE = r"""
local staging = ARGV[1]
local slot = slot_in(redis.call('HGET', SLOTS, staging))
if not slot then return redis.error_reply('the staged copy of ' .. staging .. ' is gone') end
local ekey, members = entry_key(staging), args_from(3)
for i = 1, #members, BATCH do
  local part = {}
  for j = i, math.min(i + BATCH - 1, #members) do part[#part + 1] = ARGV[2]; part[#part + 1] = members[j] end
  redis.call('ZADD', ekey, unpack(part))
end
set_bits(slot, members, true)
refresh(ekey)
return #members
"""

# The whole copy swapped in at once: the key maps to the staged slot, and its former entry is put aside.
SWAP = r"""
local key = ARGV[1]
local staging = key .. ':staging'
local slot = slot_in(redis.call('HGET', SLOTS, staging))
if not slot then return redis.error_reply('the staged copy of ' .. key .. ' is gone') end
redis.call('ZADD', entry_key(staging), '+inf', MARK)
retire(key)
redis.call('HDEL', SLOTS, staging)
redis.call('RENAME', entry_key(staging), entry_key(key))
map(key, slot)
moved()
refresh(entry_key(key))
sweep(false)
return slot
"""

# Entries that go now (a process leaving). ARGV: their cache keys.
DROP = r"""
for _, key in ipairs(ARGV) do retire(key) end
return sweep(true)
"""

# One step of the sweep whatever the fleet's last. Returns 1 while more is put aside.
SWEEP = r"""
return sweep(true)
"""


def script(body: str) -> str:
    """A script's whole text: the shared functions, then `body`. Its keys are `KEYS`."""
    constants = {
        "@NS@": NAMESPACE,
        "@MARK@": WHOLE_MARK.decode(),
        "@CACHED@": repr(CACHED),
        "@LEASE@": str(PREFIX_TTL_S),
        "@BACKSTOP@": str(BACKSTOP_S),
        "@SWEEP_MS@": str(SWEEP_EVERY_MS),
        "@WALK@": str(WALK_CHUNK),
    }
    text = _PRELUDE
    for name, value in constants.items():
        text = text.replace(name, value)
    return text + body
