// Package respstore remembers, in Redis, which deployment produced an
// OpenAI Responses Response: engines (vLLM) store Responses per engine, so
// a request naming one in previous_response_id, and GET or cancel of one,
// must reach the engine holding it. An entry maps the Response id to the
// deployment, its model group and the virtual key that created it (only
// that key may continue, read or cancel it), for TTL.
package respstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicegw/sluice/dataplane/internal/redisconn"
)

// Defaults.
const (
	// DefaultTTL is how long an entry is kept: longer than an agent's
	// session, shorter than an engine keeps a Response in memory is not
	// promised (an engine that lost it answers 404).
	DefaultTTL = 24 * time.Hour
	// DefaultCallTimeout bounds one Redis call.
	DefaultCallTimeout = 100 * time.Millisecond
	// maxIDLen bounds the ids stored (a client names them in bodies).
	maxIDLen = 256
)

// Entry is what is remembered of one Response.
type Entry struct {
	Deployment, ModelGroup, KeyID string
}

// Store is the Redis table of Responses.
type Store struct {
	conn        *redisconn.Conn
	prefix      string
	ttl         time.Duration
	callTimeout time.Duration
}

// New returns a Store over conn whose keys start with prefix (the data
// plane's Redis key prefix); ttl 0 is DefaultTTL.
func New(conn *redisconn.Conn, prefix string, ttl time.Duration) *Store {
	if ttl <= 0 {
		ttl = DefaultTTL
	}
	return &Store{conn: conn, prefix: prefix, ttl: ttl, callTimeout: DefaultCallTimeout}
}

// ErrBadID refuses an id that cannot be stored.
var ErrBadID = errors.New("respstore: invalid response id")

func (s *Store) key(id string) (string, error) {
	if id == "" || len(id) > maxIDLen || strings.ContainsAny(id, "{}\x00") {
		return "", ErrBadID
	}
	// The id is the hash tag: entries spread over a cluster's slots.
	return s.prefix + "resp:{" + id + "}", nil
}

const sep = "\x1f"

// Put remembers e for the Response id.
func (s *Store) Put(ctx context.Context, id string, e Entry) error {
	k, err := s.key(id)
	if err != nil {
		return err
	}
	v := e.Deployment + sep + e.ModelGroup + sep + e.KeyID
	ctx, cancel := context.WithTimeout(ctx, s.callTimeout)
	defer cancel()
	if c := s.conn.Cluster; c != nil {
		err = c.Set(ctx, k, v, s.ttl).Err()
	} else {
		_, err = s.conn.Pipe.Do(ctx, "SET", k, v, "PX", strconv.FormatInt(s.ttl.Milliseconds(), 10))
	}
	if err != nil {
		return fmt.Errorf("respstore: put %s: %w", id, err)
	}
	return nil
}

// Get returns the entry of the Response id (found false when there is none).
func (s *Store) Get(ctx context.Context, id string) (e Entry, found bool, err error) {
	k, err := s.key(id)
	if err != nil {
		return Entry{}, false, nil // never stored
	}
	ctx, cancel := context.WithTimeout(ctx, s.callTimeout)
	defer cancel()
	var v string
	if c := s.conn.Cluster; c != nil {
		v, err = c.Get(ctx, k).Result()
		if errors.Is(err, redis.Nil) {
			return Entry{}, false, nil
		}
	} else {
		val, derr := s.conn.Pipe.Do(ctx, "GET", k)
		if derr == nil && val.IsNil() {
			return Entry{}, false, nil
		}
		v, err = val.Str, derr
	}
	if err != nil {
		return Entry{}, false, fmt.Errorf("respstore: get %s: %w", id, err)
	}
	parts := strings.Split(v, sep)
	if len(parts) != 3 {
		return Entry{}, false, fmt.Errorf("respstore: get %s: malformed entry", id)
	}
	return Entry{Deployment: parts[0], ModelGroup: parts[1], KeyID: parts[2]}, true, nil
}
