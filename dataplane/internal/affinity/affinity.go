// Package affinity keeps a session on the deployment that served its
// previous turn (SPEC §7.2, docs/routing.md "Affinity"): the session id
// a request carries in its headers (SessionID), and the pins (org, model
// group, session) → deployment in Redis with a TTL refreshed on use
// (Store). The routing decision itself is the caller's: a pin is only a
// preference applied after every filter, and a pinned deployment that is
// filtered out, ejected or full is skipped for one request while the pin
// is kept for the session's return.
//
// A lookup is one pipelined call that also reads the fleet-wide in-flight
// count of the candidate deployments (their max_concurrency leases), so
// the load of bounded-load prefix routing is correct across proxies. The
// gateway runs it concurrently with the admission (limits) call: a
// request with a session or a long prefix adds no sequential round trip
// before forwarding, and a request with neither sends no command at all.
//
// Each deployment's live sessions (SessionsKey: the pin keys, scored by
// their pin's expiry) are counted in the same lookup for a request with
// a session, and written in the same call as the pin (PinSession), so a
// new session is placed fleet-wide on the sessions each deployment
// holds, not only on what is in flight; a new session counts from its
// placement (Place) while its first turn runs.
package affinity

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicegw/sluice/dataplane/internal/redisconn"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
)

// Defaults.
const (
	// DefaultSessionTTL is how long a pin lives after its last use.
	DefaultSessionTTL = time.Hour
	// DefaultCallTimeout bounds one affinity call.
	DefaultCallTimeout = 100 * time.Millisecond
	// MaxSessionLen bounds a session id taken from a trace header (the
	// attribution headers are bounded by the gateway).
	MaxSessionLen = 256
)

// Session id sources, in precedence order (SessionID).
const (
	SourceSession     = "x-session-id"
	SourceNamed       = "x-name-session-id"
	SourceTraceparent = "traceparent"
	SourceTraceID     = "x-trace-id"
)

// SessionID returns the session id of a request's headers and where it was
// found, in this precedence:
//
//  1. x-session-id;
//  2. any x-<name>-session-id (x-claude-code-session-id, x-codex-session-id,
//     x-litellm-session-id, ...): the first by header name when several
//     are sent, so the choice is deterministic;
//  3. the trace id of a W3C traceparent (version-traceid-parentid-flags);
//  4. x-trace-id.
//
// A trace id is only a session id when nothing names one: an agent loop
// usually keeps one trace over its turns. Empty: the request has none.
func SessionID(h http.Header) (id, source string) {
	if v := h.Get("X-Session-Id"); v != "" {
		return v, SourceSession
	}
	var names []string
	const suffix = "-session-id"
	for name := range h {
		if len(name) > len("x-"+suffix) && strings.EqualFold(name[:2], "x-") && strings.EqualFold(name[len(name)-len(suffix):], suffix) && h.Get(name) != "" {
			names = append(names, name)
		}
	}
	if len(names) > 0 {
		slices.Sort(names)
		return h.Get(names[0]), SourceNamed
	}
	if tid, ok := traceparentID(h.Get("Traceparent")); ok {
		return tid, SourceTraceparent
	}
	if v := h.Get("X-Trace-Id"); v != "" && len(v) <= MaxSessionLen {
		return v, SourceTraceID
	}
	return "", ""
}

// traceparentID returns the trace id of a W3C traceparent header
// ("00-<32 hex>-<16 hex>-<2 hex>"); the all-zero id is invalid.
func traceparentID(v string) (string, bool) {
	parts := strings.Split(v, "-")
	if len(parts) < 4 || len(parts[0]) != 2 || len(parts[1]) != 32 {
		return "", false
	}
	tid := strings.ToLower(parts[1])
	if _, err := hex.DecodeString(tid); err != nil || tid == strings.Repeat("0", 32) {
		return "", false
	}
	return tid, true
}

// Config configures a Store.
type Config struct {
	// Conn is the data plane's Redis (redisconn.Open), shared with the
	// limits store.
	Conn *redisconn.Conn
	// KeyPrefix is prepended to every key (the limits store's prefix); it
	// must not contain '{' or '}'.
	KeyPrefix string
	// CallTimeout bounds one call (0: DefaultCallTimeout).
	CallTimeout time.Duration
}

// Store keeps session pins in Redis. It is safe for concurrent use.
type Store struct {
	cfg Config
}

// New validates cfg and returns a Store.
func New(cfg Config) (*Store, error) {
	if cfg.Conn == nil || (cfg.Conn.Pipe == nil) == (cfg.Conn.Cluster == nil) {
		return nil, errors.New("affinity: a Redis connection is required")
	}
	if strings.ContainsAny(cfg.KeyPrefix, "{}") {
		return nil, fmt.Errorf("affinity: KeyPrefix %q must not contain '{' or '}'", cfg.KeyPrefix)
	}
	switch {
	case cfg.CallTimeout == 0:
		cfg.CallTimeout = DefaultCallTimeout
	case cfg.CallTimeout < 0:
		return nil, fmt.Errorf("affinity: CallTimeout must be positive (got %v)", cfg.CallTimeout)
	}
	return &Store{cfg: cfg}, nil
}

// PinKey is the Redis key of the pin of (org, group, session):
// <prefix>{o:<org>}:aff:<sha-256 of group NUL session, 32 hex>. The hash
// bounds the key's length whatever the session id, and the org's hash
// tag keeps an org's keys on one Cluster slot, like its limits.
func (s *Store) PinKey(org, group, session string) string {
	sum := sha256.Sum256([]byte(group + "\x00" + session))
	return s.cfg.KeyPrefix + "{o:" + org + "}:aff:" + hex.EncodeToString(sum[:16])
}

// Lookup is the answer of one lookup. A lookup that fails or times out
// may have answered part of its commands; the error says which did not.
type Lookup struct {
	// Pinned is the deployment the session is pinned to ("": none, no
	// session was asked, or the pin could not be read: see PinRead).
	Pinned string
	// PinRead is set when the pin was asked and Redis answered for it
	// (found or absent). A pin asked and not read is unknown: the session
	// may well be pinned, so the caller must neither treat it as a new
	// session nor write a pin over it.
	PinRead bool
	// Loads are the fleet-wide live lease counts of the load keys asked,
	// in order (-1: unknown).
	Loads []int64
	// Prefill are the fleet-wide prefill tokens in flight of the prefill
	// keys asked, in order (-1: unknown; a missing hash or field is 0).
	Prefill []int64
	// Turn is the session's last turn as recorded with its pin (zero:
	// none recorded, or no session was asked).
	Turn Turn
	// Sessions are the live sessions (pinned or being placed) of the
	// session sets asked (SessionsKey), in order (-1: unknown).
	Sessions []int64
	// Member reports, per session set asked, whether the pin key Keys.Pin
	// is a live member of it (the session is counted there: placed while
	// its first turn runs, or pinned by a write not read yet).
	Member []bool
}

// SessionsComplete reports whether every session count asked was
// answered (and at least one was asked).
func (l Lookup) SessionsComplete() bool {
	return len(l.Sessions) > 0 && !slices.Contains(l.Sessions, -1)
}

// Turn is what a session's last served turn left in its deployment's
// prefix cache, recorded with the pin (PinTurn): the deployment and the
// engine's prompt and completion tokens, and the proxy's prompt estimate
// of that turn (its ratio to the engine's count calibrates the next
// estimate).
type Turn struct {
	Deployment                   string
	Prompt, Completion, Estimate int64
}

// turnKey is the key of a session's turn record, beside its pin (same
// hash tag).
func turnKey(pinKey string) string { return pinKey + ":turn" }

func (t Turn) encode() string {
	return t.Deployment + "\n" + strconv.FormatInt(t.Prompt, 10) + " " + strconv.FormatInt(t.Completion, 10) + " " + strconv.FormatInt(t.Estimate, 10)
}

func decodeTurn(v string) Turn {
	dep, nums, ok := strings.Cut(v, "\n")
	f := strings.Fields(nums)
	if !ok || dep == "" || len(f) != 3 {
		return Turn{}
	}
	var n [3]int64
	for i := range n {
		x, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil || x < 0 {
			return Turn{}
		}
		n[i] = x
	}
	return Turn{Deployment: dep, Prompt: n[0], Completion: n[1], Estimate: n[2]}
}

// Keys are what one lookup reads.
type Keys struct {
	// Pin is the session's pin key ("": none); its turn record is read
	// with it.
	Pin string
	// Loads are lease sets (limits.Limiter.DeploymentLeaseKey) whose live
	// leases are counted.
	Loads []string
	// Prefill are prefill hashes (limits.Limiter.DeploymentPrefillKey)
	// whose field PrefillField is read.
	Prefill      []string
	PrefillField string
	// Sessions are session sets (SessionsKey) whose live members are
	// counted; with a Pin, whether the pin key is a live member of each
	// is read too (Lookup.Member).
	Sessions []string
}

// SessionsKey is the Redis key of a deployment's live sessions: a zset
// of pin keys scored by the expiry (ms) of the session's pin, or of its
// placement while its first turn runs (Place). It is written in the same
// call as the pin (PinSession), so a request without a session never
// touches it, and it lives on the deployment's own hash tag
// (<prefix>{d:<deployment>}:sessions), like its leases on their own.
func (s *Store) SessionsKey(deployment string) string {
	return s.cfg.KeyPrefix + "{d:" + deployment + "}:sessions"
}

// PlaceTTL bounds how long a new session's placement (Place) counts
// without its pin being written: a proxy that died mid-turn leaves it
// counted this long at most.
const PlaceTTL = 10 * time.Minute

// LoadsComplete reports whether every load asked was answered. Partial
// loads must not be mixed with a proxy's own counts for the rest: a
// candidate whose fleet-wide count is missing would look idle next to
// the others.
func (l Lookup) LoadsComplete() bool { return !slices.Contains(l.Loads, -1) }

// Lookup reads the pin of pinKey (skipped when empty) and counts the live
// leases (score above now, in ms) of each of loadKeys, in one pipelined
// call bounded by the store's call timeout.
func (s *Store) Lookup(ctx context.Context, pinKey string, loadKeys []string, now time.Time) (Lookup, error) {
	return s.LookupKeys(ctx, Keys{Pin: pinKey, Loads: loadKeys}, now)
}

// LookupKeys reads k in one pipelined call: the pin and turn record, the
// live lease counts, and the prefill tokens in flight.
func (s *Store) LookupKeys(ctx context.Context, k Keys, now time.Time) (Lookup, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CallTimeout)
	defer cancel()
	out := Lookup{Loads: make([]int64, len(k.Loads))}
	if len(k.Prefill) > 0 {
		out.Prefill = make([]int64, len(k.Prefill))
	}
	for i := range out.Loads {
		out.Loads[i] = -1
	}
	for i := range out.Prefill {
		out.Prefill[i] = -1
	}
	if len(k.Sessions) > 0 {
		out.Member = make([]bool, len(k.Sessions))
		out.Sessions = make([]int64, len(k.Sessions))
		for i := range out.Sessions {
			out.Sessions[i] = -1
		}
	}
	nowMS := "(" + strconv.FormatInt(now.UnixMilli(), 10)
	if c := s.cfg.Conn.Cluster; c != nil {
		pipe := c.Pipeline()
		var pin, turn *redis.StringCmd
		if k.Pin != "" {
			pin = pipe.Get(ctx, k.Pin)
			turn = pipe.Get(ctx, turnKey(k.Pin))
		}
		counts := make([]*redis.IntCmd, len(k.Loads))
		for i, key := range k.Loads {
			counts[i] = pipe.ZCount(ctx, key, nowMS, "+inf")
		}
		pfs := make([]*redis.StringCmd, len(k.Prefill))
		for i, key := range k.Prefill {
			pfs[i] = pipe.HGet(ctx, key, k.PrefillField)
		}
		sess := make([]*redis.IntCmd, len(k.Sessions))
		mem := make([]*redis.FloatCmd, len(k.Sessions))
		for i, key := range k.Sessions {
			sess[i] = pipe.ZCount(ctx, key, nowMS, "+inf")
			if k.Pin != "" {
				mem[i] = pipe.ZScore(ctx, key, k.Pin)
			}
		}
		_, _ = pipe.Exec(ctx)
		var errs []error
		if pin != nil {
			switch v, err := pin.Result(); {
			case err == nil:
				out.Pinned, out.PinRead = v, true
			case errors.Is(err, redis.Nil):
				out.PinRead = true
			default:
				errs = append(errs, err)
			}
			if v, err := turn.Result(); err == nil {
				out.Turn = decodeTurn(v)
			}
		}
		for i, c := range counts {
			if n, err := c.Result(); err == nil {
				out.Loads[i] = n
			} else {
				errs = append(errs, err)
			}
		}
		for i, c := range pfs {
			switch v, err := c.Result(); {
			case err == nil:
				out.Prefill[i], _ = strconv.ParseInt(v, 10, 64)
			case errors.Is(err, redis.Nil):
				out.Prefill[i] = 0
			default:
				errs = append(errs, err)
			}
		}
		for i, c := range sess {
			if n, err := c.Result(); err == nil {
				out.Sessions[i] = n
			} else {
				errs = append(errs, err)
			}
			if mem[i] != nil {
				if v, err := mem[i].Result(); err == nil {
					out.Member[i] = v > float64(now.UnixMilli())
				}
			}
		}
		return out, errors.Join(errs...)
	}
	cmds := make([]redispipe.Cmd, 0, 2+len(k.Loads)+len(k.Prefill)+len(k.Sessions))
	if k.Pin != "" {
		cmds = append(cmds, redispipe.Cmd{Args: []any{"GET", k.Pin}}, redispipe.Cmd{Args: []any{"GET", turnKey(k.Pin)}})
	}
	for _, key := range k.Loads {
		cmds = append(cmds, redispipe.Cmd{Args: []any{"ZCOUNT", key, nowMS, "+inf"}})
	}
	for _, key := range k.Prefill {
		cmds = append(cmds, redispipe.Cmd{Args: []any{"HGET", key, k.PrefillField}})
	}
	for _, key := range k.Sessions {
		cmds = append(cmds, redispipe.Cmd{Args: []any{"ZCOUNT", key, nowMS, "+inf"}})
		if k.Pin != "" {
			cmds = append(cmds, redispipe.Cmd{Args: []any{"ZSCORE", key, k.Pin}})
		}
	}
	vals, errs := s.cfg.Conn.Pipe.DoMulti(ctx, cmds)
	var bad []error
	if k.Pin != "" {
		switch {
		case errs[0] != nil:
			bad = append(bad, errs[0])
		case vals[0].IsNil():
			out.PinRead = true
		case vals[0].Kind == '$':
			out.Pinned, out.PinRead = vals[0].Str, true
		default:
			bad = append(bad, fmt.Errorf("affinity: GET answered kind %q", vals[0].Kind))
		}
		if errs[1] == nil && vals[1].Kind == '$' {
			out.Turn = decodeTurn(vals[1].Str)
		}
		vals, errs = vals[2:], errs[2:]
	}
	for i := range k.Loads {
		switch {
		case errs[i] != nil:
			bad = append(bad, errs[i])
		case vals[i].Kind == ':':
			out.Loads[i] = vals[i].Int
		default:
			bad = append(bad, fmt.Errorf("affinity: ZCOUNT answered kind %q", vals[i].Kind))
		}
	}
	vals, errs = vals[len(k.Loads):], errs[len(k.Loads):]
	for i := range k.Prefill {
		switch {
		case errs[i] != nil:
			bad = append(bad, errs[i])
		case vals[i].IsNil(): // no prefill recorded
			out.Prefill[i] = 0
		case vals[i].Kind == '$':
			out.Prefill[i], _ = strconv.ParseInt(vals[i].Str, 10, 64)
		default:
			bad = append(bad, fmt.Errorf("affinity: HGET answered kind %q", vals[i].Kind))
		}
	}
	vals, errs = vals[len(k.Prefill):], errs[len(k.Prefill):]
	for i := range k.Sessions {
		switch {
		case errs[0] != nil:
			bad = append(bad, errs[0])
		case vals[0].Kind == ':':
			out.Sessions[i] = vals[0].Int
		default:
			bad = append(bad, fmt.Errorf("affinity: ZCOUNT answered kind %q", vals[0].Kind))
		}
		vals, errs = vals[1:], errs[1:]
		if k.Pin != "" {
			if errs[0] == nil && vals[0].Kind == '$' {
				score, _ := strconv.ParseFloat(vals[0].Str, 64)
				out.Member[i] = score > float64(now.UnixMilli())
			}
			vals, errs = vals[1:], errs[1:]
		}
	}
	return out, errors.Join(bad...)
}

// Pin sets (or refreshes) the pin of pinKey to deployment for ttl.
func (s *Store) Pin(ctx context.Context, pinKey, deployment string, ttl time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CallTimeout)
	defer cancel()
	ms := max(ttl.Milliseconds(), 1)
	if c := s.cfg.Conn.Cluster; c != nil {
		return c.Set(ctx, pinKey, deployment, time.Duration(ms)*time.Millisecond).Err()
	}
	_, err := s.cfg.Conn.Pipe.Do(ctx, "SET", pinKey, deployment, "PX", ms)
	return err
}

// PinTurn is Pin that also records the turn the deployment served (the
// turn record lives as long as the pin), in one pipelined call.
func (s *Store) PinTurn(ctx context.Context, pinKey, deployment string, ttl time.Duration, t Turn) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CallTimeout)
	defer cancel()
	ms := max(ttl.Milliseconds(), 1)
	t.Deployment = deployment
	if c := s.cfg.Conn.Cluster; c != nil {
		pipe := c.Pipeline()
		pipe.Set(ctx, pinKey, deployment, time.Duration(ms)*time.Millisecond)
		pipe.Set(ctx, turnKey(pinKey), t.encode(), time.Duration(ms)*time.Millisecond)
		_, err := pipe.Exec(ctx)
		return err
	}
	_, errs := s.cfg.Conn.Pipe.DoMulti(ctx, []redispipe.Cmd{
		{Args: []any{"SET", pinKey, deployment, "PX", ms}},
		{Args: []any{"SET", turnKey(pinKey), t.encode(), "PX", ms}},
	})
	return errors.Join(errs...)
}

// SessionWrite is what PinSession writes beside the pin.
type SessionWrite struct {
	// Sessions is the served deployment's session set (SessionsKey): the
	// pin key joins it, scored by the pin's expiry.
	Sessions string
	// Placed is the session set of the deployment the session was placed
	// on (Place) when another one served it ("": none): the placement is
	// withdrawn.
	Placed string
	// Turn, when set, is recorded with the pin (PinTurn).
	Turn *Turn
}

// PinSession is Pin (or PinTurn) that also counts the session in its
// deployment's session set, in one pipelined call: the set's expired
// members are trimmed, the pin key is added scored by the pin's expiry,
// and the set lives as long as its newest pin. now is the clock of the
// scores.
func (s *Store) PinSession(ctx context.Context, pinKey, deployment string, ttl time.Duration, w SessionWrite, now time.Time) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CallTimeout)
	defer cancel()
	ms := max(ttl.Milliseconds(), 1)
	exp := now.UnixMilli() + ms
	nowMS := strconv.FormatInt(now.UnixMilli(), 10)
	var turn string
	if w.Turn != nil {
		t := *w.Turn
		t.Deployment = deployment
		turn = t.encode()
	}
	if c := s.cfg.Conn.Cluster; c != nil {
		// The pin and the session set are on different slots: a
		// Cluster pipeline sends each node its own commands.
		d := time.Duration(ms) * time.Millisecond
		pipe := c.Pipeline()
		pipe.Set(ctx, pinKey, deployment, d)
		if w.Turn != nil {
			pipe.Set(ctx, turnKey(pinKey), turn, d)
		}
		if w.Sessions != "" {
			pipe.ZRemRangeByScore(ctx, w.Sessions, "-inf", nowMS)
			pipe.ZAdd(ctx, w.Sessions, redis.Z{Score: float64(exp), Member: pinKey})
			pipe.PExpire(ctx, w.Sessions, d)
		}
		if w.Placed != "" && w.Placed != w.Sessions {
			pipe.ZRem(ctx, w.Placed, pinKey)
		}
		_, err := pipe.Exec(ctx)
		return err
	}
	cmds := []redispipe.Cmd{{Args: []any{"SET", pinKey, deployment, "PX", ms}}}
	if w.Turn != nil {
		cmds = append(cmds, redispipe.Cmd{Args: []any{"SET", turnKey(pinKey), turn, "PX", ms}})
	}
	if w.Sessions != "" {
		cmds = append(cmds,
			redispipe.Cmd{Args: []any{"ZREMRANGEBYSCORE", w.Sessions, "-inf", nowMS}},
			redispipe.Cmd{Args: []any{"ZADD", w.Sessions, exp, pinKey}},
			redispipe.Cmd{Args: []any{"PEXPIRE", w.Sessions, ms}})
	}
	if w.Placed != "" && w.Placed != w.Sessions {
		cmds = append(cmds, redispipe.Cmd{Args: []any{"ZREM", w.Placed, pinKey}})
	}
	_, errs := s.cfg.Conn.Pipe.DoMulti(ctx, cmds)
	return errors.Join(errs...)
}

// Place counts a new session in the session set of the deployment it was
// placed on while its turn runs (its pin is written when the turn
// succeeds: PinSession), for PlaceTTL at most, so the sessions placed
// after it see it, and a next turn of the session that reads no pin yet
// (Lookup.Member) stays there. from, when set, is the session set of the
// deployment it was placed on before (an earlier attempt of the same
// turn): the placement moves, in the same pipelined call. The score only
// grows (ZADD GT): a placement never shortens the entry of a pin written
// meanwhile. The set's expiry is left as it is (a pin sets it).
func (s *Store) Place(ctx context.Context, sessionsKey, pinKey, from string, now time.Time) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CallTimeout)
	defer cancel()
	exp := now.Add(PlaceTTL).UnixMilli()
	move := from != "" && from != sessionsKey
	if c := s.cfg.Conn.Cluster; c != nil {
		// The two sets are on their deployments' own slots: a Cluster
		// pipeline sends each node its own command.
		pipe := c.Pipeline()
		pipe.ZAddGT(ctx, sessionsKey, redis.Z{Score: float64(exp), Member: pinKey})
		if move {
			pipe.ZRem(ctx, from, pinKey)
		}
		_, err := pipe.Exec(ctx)
		return err
	}
	cmds := []redispipe.Cmd{{Args: []any{"ZADD", sessionsKey, "GT", exp, pinKey}}}
	if move {
		cmds = append(cmds, redispipe.Cmd{Args: []any{"ZREM", from, pinKey}})
	}
	_, errs := s.cfg.Conn.Pipe.DoMulti(ctx, cmds)
	return errors.Join(errs...)
}

// Unplace withdraws a placement (Place) whose turn failed: the session
// has no pin.
func (s *Store) Unplace(ctx context.Context, sessionsKey, pinKey string) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CallTimeout)
	defer cancel()
	if c := s.cfg.Conn.Cluster; c != nil {
		return c.ZRem(ctx, sessionsKey, pinKey).Err()
	}
	_, err := s.cfg.Conn.Pipe.Do(ctx, "ZREM", sessionsKey, pinKey)
	return err
}
