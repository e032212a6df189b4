"""The Lua scripts of RedisStore's sliding-window rate limits (see gateway/redis_store.py).

Each runs atomically on the server, so two gateway replicas can never both take the last
request or the last tokens of a window. The window's arithmetic matches
gateway/sliding_window.py, which the single-process store uses.
"""

# live(key, oldest): drop the seconds before `oldest`, return the sum of the rest and the
# rest as {second, amount} pairs. wait(...): seconds until `need` more fits under `limit`,
# the oldest seconds leaving first, each at second + span (sliding_window.wait_s).
LIB = """
local function live(key, oldest)
  local flat = redis.call('HGETALL', key)
  local total, kept, dead = 0, {}, {}
  for i = 1, #flat, 2 do
    local second, amount = tonumber(flat[i]), tonumber(flat[i + 1])
    if second == nil or amount == nil or second < oldest then
      dead[#dead + 1] = flat[i]
    else
      total = total + amount
      kept[#kept + 1] = {second, amount}
    end
  end
  if #dead > 0 then redis.call('HDEL', key, unpack(dead)) end
  return total, kept
end
local function wait(kept, total, need, limit, now, span)
  table.sort(kept, function(a, b) return a[1] < b[1] end)
  for _, bucket in ipairs(kept) do
    total = total - bucket[2]
    if total + need <= limit then return math.max(1, math.ceil(bucket[1] + span - now)) end
  end
  return span
end
local now = tonumber(ARGV[1])
local second = math.floor(now)
local oldest = second - tonumber(ARGV[2])
local span = tonumber(ARGV[3])
"""
# KEYS: keys table, req hash, tok hash. ARGV: now, window, span, key hash ('' for none),
# rpm, tpm (-1: unlimited). Returns {1, second, requests in the window with this one, tokens
# in the window} or {-1 rpm | -2 tpm | -3 revoked, wait}.
ADMIT = LIB + """
if ARGV[4] ~= '' and redis.call('HEXISTS', KEYS[1], ARGV[4]) == 0 then return {-3, 0} end
local rpm, tpm = tonumber(ARGV[5]), tonumber(ARGV[6])
local used, used_buckets = live(KEYS[3], oldest)
if tpm >= 0 and used >= tpm then return {-2, wait(used_buckets, used, 1, tpm, now, span)} end
local made, buckets = live(KEYS[2], oldest)
if rpm >= 0 and made >= rpm then return {-1, wait(buckets, made, 1, rpm, now, span)} end
redis.call('HINCRBY', KEYS[2], string.format('%d', second), 1)
redis.call('EXPIRE', KEYS[2], span + 1)
return {1, second, made + 1, used}
"""
# KEYS: tok hash. ARGV: now, window, span, tokens, tpm. Returns {1, second, tokens in the
# window with these} or {-2, wait}.
RESERVE = LIB + """
local need, tpm = tonumber(ARGV[4]), tonumber(ARGV[5])
local used, buckets = live(KEYS[1], oldest)
if used + need > tpm then return {-2, wait(buckets, used, need, tpm, now, span)} end
redis.call('HINCRBY', KEYS[1], string.format('%d', second), need)
redis.call('EXPIRE', KEYS[1], span + 1)
return {1, second, used + need}
"""
# KEYS: req or tok hash. ARGV: now, window, span, second, amount (negative: give back).
# Adds to that second while it is in the window; a second never goes below zero.
ADD = LIB + """
local at = tonumber(ARGV[4])
if at < oldest then return 0 end
local field = string.format('%d', at)
local value = redis.call('HINCRBY', KEYS[1], field, tonumber(ARGV[5]))
if value <= 0 then redis.call('HDEL', KEYS[1], field) end
redis.call('EXPIRE', KEYS[1], span + 1)
return value
"""
