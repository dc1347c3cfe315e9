package affinity

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/redisconn"
	"github.com/sluicegw/sluice/internal/testsvc"
)

func TestSessionID(t *testing.T) {
	h := func(kv ...string) http.Header {
		out := http.Header{}
		for i := 0; i+1 < len(kv); i += 2 {
			out.Set(kv[i], kv[i+1])
		}
		return out
	}
	tp := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	for _, c := range []struct {
		hd       http.Header
		id, from string
	}{
		{h("X-Session-Id", "a", "X-Litellm-Session-Id", "b", "Traceparent", tp), "a", SourceSession},
		{h("X-Litellm-Session-Id", "b", "X-Claude-Code-Session-Id", "c", "Traceparent", tp), "c", SourceNamed},
		{h("X-Litellm-Session-Id", "b"), "b", SourceNamed},
		{h("Traceparent", tp, "X-Trace-Id", "t"), "4bf92f3577b34da6a3ce929d0e0e4736", SourceTraceparent},
		{h("Traceparent", "00-00000000000000000000000000000000-00f067aa0ba902b7-01", "X-Trace-Id", "t"), "t", SourceTraceID},
		{h("Traceparent", "garbage"), "", ""},
		{h("X-Session-Id", ""), "", ""},
		{h(), "", ""},
	} {
		id, from := SessionID(c.hd)
		require.Equal(t, c.id, id, "%v", c.hd)
		require.Equal(t, c.from, from, "%v", c.hd)
	}
}

func TestStore(t *testing.T) {
	const addr = "127.0.0.1:6379"
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = rdb.Close() })
	require.NoError(t, rdb.Ping(context.Background()).Err(), "Redis must run on %s", addr)
	conn, err := redisconn.Open("redis://"+addr+"/0", nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	_, err = New(Config{Conn: conn, KeyPrefix: "a{b"})
	require.Error(t, err)
	testStore(t, conn, rdb)
}

// TestStoreCluster: the same on a 3-master Redis Cluster, where the pin
// (the org's slot) and the load keys (each deployment's slot) sit on
// different nodes: one lookup still reads them all, with the same
// answers as on one Redis.
func TestStoreCluster(t *testing.T) {
	rc := testsvc.StartRedisCluster(t)
	conn, err := redisconn.Open("", rc.Addrs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	testStore(t, conn, rc.Client(t))
}

// testStore checks pins and load counts through conn (rdb: the same Redis
// for setup and checks).
func testStore(t *testing.T, conn *redisconn.Conn, rdb redis.UniversalClient) {
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := "aff" + hex.EncodeToString(b[:]) + ":"
	// A generous deadline: a Cluster client's first call also loads the
	// slot map and dials every node, on a loaded test machine.
	s, err := New(Config{Conn: conn, KeyPrefix: prefix, CallTimeout: time.Second})
	require.NoError(t, err)
	ctx := context.Background()
	key := s.PinKey("o1", "g", "s1")
	require.NotEqual(t, key, s.PinKey("o1", "g2", "s1"))
	require.NotEqual(t, key, s.PinKey("o2", "g", "s1"))
	now := time.Now()
	// Load keys as the limits lay them out: each deployment's own hash tag.
	var lks []string
	for _, d := range []string{"d1", "d2", "d3", "none"} {
		lks = append(lks, prefix+"{o:deployment:"+d+"}:par:deployment:"+d)
	}
	t.Cleanup(func() {
		for _, k := range append([]string{key}, lks...) {
			rdb.Del(ctx, k)
		}
	})
	live := func(k string, n int) {
		for i := range n {
			rdb.ZAdd(ctx, k, redis.Z{Score: float64(now.Add(time.Minute).UnixMilli()), Member: "live" + strconv.Itoa(i)})
		}
		rdb.ZAdd(ctx, k, redis.Z{Score: float64(now.Add(-time.Second).UnixMilli()), Member: "expired"})
	}
	live(lks[0], 2)
	live(lks[1], 0)
	live(lks[2], 5)
	got, err := s.Lookup(ctx, key, lks, now)
	require.NoError(t, err)
	require.Equal(t, Lookup{Pinned: "", PinRead: true, Loads: []int64{2, 0, 5, 0}}, got)
	require.True(t, got.LoadsComplete())
	require.NoError(t, s.Pin(ctx, key, "d1", time.Hour))
	got, err = s.Lookup(ctx, key, nil, now)
	require.NoError(t, err)
	require.Equal(t, Lookup{Pinned: "d1", PinRead: true, Loads: []int64{}}, got)
	ttl, err := rdb.PTTL(ctx, key).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, 59*time.Minute, strconv.FormatInt(int64(ttl), 10))
	// No session: loads only.
	got, err = s.Lookup(ctx, "", lks[:1], now)
	require.NoError(t, err)
	require.Equal(t, Lookup{Loads: []int64{2}}, got)
	// A lookup whose deadline has passed: nothing known, an error.
	dead, cancel := context.WithDeadline(ctx, now.Add(-time.Second))
	defer cancel()
	got, err = s.Lookup(dead, key, lks, now)
	require.Error(t, err)
	require.False(t, got.PinRead)
	require.Empty(t, got.Pinned)
	require.False(t, got.LoadsComplete())
}

// TestStoreTurnsAndPrefill: a pin written with its turn is read back with
// it, and prefill hashes are read (a missing one is 0), in one lookup.
func TestStoreTurnsAndPrefill(t *testing.T) {
	const addr = "127.0.0.1:6379"
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = rdb.Close() })
	require.NoError(t, rdb.Ping(context.Background()).Err(), "Redis must run on %s", addr)
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := "aff" + hex.EncodeToString(b[:]) + ":"
	ctx := context.Background()
	t.Cleanup(func() {
		keys, _ := rdb.Keys(ctx, prefix+"*").Result()
		if len(keys) > 0 {
			rdb.Del(ctx, keys...)
		}
	})
	for _, url := range []string{"redis://" + addr + "/0"} {
		conn, err := redisconn.Open(url, nil)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		s, err := New(Config{Conn: conn, KeyPrefix: prefix})
		require.NoError(t, err)
		key := s.PinKey("o1", "g", "s1")
		require.NoError(t, s.PinTurn(ctx, key, "d2", time.Hour, Turn{Prompt: 20000, Completion: 300, Estimate: 18000}))
		pk := prefix + "pf"
		require.NoError(t, rdb.HSet(ctx, pk, "pt", 4096).Err())
		got, err := s.LookupKeys(ctx, Keys{Pin: key, Prefill: []string{pk, prefix + "none"}, PrefillField: "pt"}, time.Now())
		require.NoError(t, err)
		require.Equal(t, Lookup{Pinned: "d2", PinRead: true, Loads: []int64{}, Prefill: []int64{4096, 0},
			Turn: Turn{Deployment: "d2", Prompt: 20000, Completion: 300, Estimate: 18000}}, got)
		ttl, err := rdb.PTTL(ctx, key+":turn").Result()
		require.NoError(t, err)
		require.Greater(t, ttl, 59*time.Minute, "the turn record lives as long as the pin")
		// A plain Pin leaves the old turn record (its deployment names where
		// it was served, so a turn elsewhere is never taken as cached).
		require.NoError(t, s.Pin(ctx, key, "d1", time.Hour))
		got, err = s.Lookup(ctx, key, nil, time.Now())
		require.NoError(t, err)
		require.Equal(t, "d1", got.Pinned)
		require.Equal(t, "d2", got.Turn.Deployment)
	}
}

// TestStoreSessions: a pin written with PinSession counts the session in
// its deployment's session set (scored by the pin's expiry, the set
// trimmed and expiring with its newest pin), a placement counts until
// withdrawn or moved by the pin's call, and a lookup counts the live
// members; on one Redis and on a Redis Cluster (the pin on the org's
// slot, each set on its deployment's).
func TestStoreSessions(t *testing.T) {
	const addr = "127.0.0.1:6379"
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = rdb.Close() })
	require.NoError(t, rdb.Ping(context.Background()).Err(), "Redis must run on %s", addr)
	conn, err := redisconn.Open("redis://"+addr+"/0", nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	t.Run("redis", func(t *testing.T) { testStoreSessions(t, conn, rdb) })
	rc := testsvc.StartRedisCluster(t)
	cconn, err := redisconn.Open("", rc.Addrs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cconn.Close() })
	t.Run("cluster", func(t *testing.T) { testStoreSessions(t, cconn, rc.Client(t)) })
}

func testStoreSessions(t *testing.T, conn *redisconn.Conn, rdb redis.UniversalClient) {
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := "aff" + hex.EncodeToString(b[:]) + ":"
	s, err := New(Config{Conn: conn, KeyPrefix: prefix, CallTimeout: time.Second})
	require.NoError(t, err)
	ctx := context.Background()
	now := time.Now()
	d1, d2 := s.SessionsKey("d1"), s.SessionsKey("d2")
	require.NotEqual(t, d1, d2)
	k1, k2, k3 := s.PinKey("o1", "g", "s1"), s.PinKey("o1", "g", "s2"), s.PinKey("o2", "g", "s3")
	t.Cleanup(func() {
		for _, k := range []string{d1, d2, k1, k2, k3, turnKey(k1)} {
			rdb.Del(ctx, k)
		}
	})
	// An expired member is not counted, and the pin's call trims it.
	rdb.ZAdd(ctx, d1, redis.Z{Score: float64(now.Add(-time.Second).UnixMilli()), Member: "old"})
	require.NoError(t, s.PinSession(ctx, k1, "d1", time.Hour, SessionWrite{Sessions: d1, Turn: &Turn{Prompt: 10, Completion: 2, Estimate: 9}}, now))
	require.NoError(t, s.Place(ctx, d1, k2, "", now))
	require.NoError(t, s.Place(ctx, d2, k3, "", now))
	got, err := s.LookupKeys(ctx, Keys{Pin: k1, Sessions: []string{d1, d2}}, now)
	require.NoError(t, err)
	require.Equal(t, "d1", got.Pinned)
	require.Equal(t, Turn{Deployment: "d1", Prompt: 10, Completion: 2, Estimate: 9}, got.Turn)
	require.Equal(t, []int64{2, 1}, got.Sessions)
	require.Equal(t, []bool{true, false}, got.Member, "s1 counts on d1")
	require.True(t, got.SessionsComplete())
	n, err := rdb.ZScore(ctx, d1, "old").Result()
	require.ErrorIs(t, err, redis.Nil, "trimmed: %v", n)
	ttl, err := rdb.PTTL(ctx, d1).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, 59*time.Minute)
	// s2 placed on d1 but served by d2: the pin's call moves it.
	require.NoError(t, s.PinSession(ctx, k2, "d2", time.Hour, SessionWrite{Sessions: d2, Placed: d1}, now))
	// A placement never shortens the entry of a pin (ZADD GT): s1 keeps
	// its pin's expiry on d1.
	require.NoError(t, s.Place(ctx, d1, k1, "", now))
	score, err := rdb.ZScore(ctx, d1, k1).Result()
	require.NoError(t, err)
	require.Equal(t, float64(now.Add(time.Hour).UnixMilli()), score)
	// s3's next attempt went to d1: its placement moves there.
	require.NoError(t, s.Place(ctx, d1, k3, d2, now))
	got, err = s.LookupKeys(ctx, Keys{Pin: k3, Sessions: []string{d1, d2}}, now)
	require.NoError(t, err)
	require.Equal(t, []int64{2, 1}, got.Sessions, "s1 and s3 on d1, s2 on d2")
	require.Equal(t, []bool{true, false}, got.Member, "s3 moved to d1")
	// s3's turn failed: its placement is withdrawn.
	require.NoError(t, s.Unplace(ctx, d1, k3))
	got, err = s.LookupKeys(ctx, Keys{Pin: k2, Sessions: []string{d1, d2}}, now)
	require.NoError(t, err)
	require.Equal(t, []int64{1, 1}, got.Sessions)
	require.Equal(t, []bool{false, true}, got.Member, "s2 moved to d2")
	// Later than every score: nothing live.
	got, err = s.LookupKeys(ctx, Keys{Sessions: []string{d1, d2}}, now.Add(2*time.Hour))
	require.NoError(t, err)
	require.Equal(t, []int64{0, 0}, got.Sessions)
	require.False(t, Lookup{}.SessionsComplete())
}
