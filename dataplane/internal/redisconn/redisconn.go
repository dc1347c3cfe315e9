// Package redisconn is the one place the data plane connects to Redis:
// the limits store today, the affinity tables next, over the same
// connections. One Redis is reached through the pipelining client of
// package redispipe (see that package for why the request path does not
// use go-redis there); a Redis Cluster through go-redis, which routes by
// slot. Every call carries its own deadline; dialing is bounded too, so an
// unreachable Redis fails a call fast rather than stalling it.
package redisconn

import (
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
)

// DialTimeout bounds connecting to Redis.
const DialTimeout = 250 * time.Millisecond

// Conn is an open Redis connection: exactly one of Pipe (one Redis) and
// Cluster (a Redis Cluster) is set.
type Conn struct {
	Pipe    *redispipe.Client
	Cluster *redis.ClusterClient
}

// Open connects to the Redis Cluster of clusterAddrs when set, else to
// the Redis of url (redis://host:port/db).
func Open(url string, clusterAddrs []string) (*Conn, error) {
	if len(clusterAddrs) > 0 {
		rdb := redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: clusterAddrs, ContextTimeoutEnabled: true, DialTimeout: DialTimeout,
			// A call's own deadline bounds it; retries would only spend
			// that budget on a dead connection, and one dial per call
			// fails a refused connection at once. RESP2: the scripts
			// return integer arrays; RESP3 would only add a
			// push-notification check to every call.
			PoolSize: 256, MinIdleConns: 4, MaxRetries: -1, DialerRetries: 1, Protocol: 2,
		})
		return &Conn{Cluster: rdb}, nil
	}
	opt, err := redispipe.ParseURL(url)
	if err != nil {
		return nil, err
	}
	opt.DialTimeout = DialTimeout
	pipe, err := redispipe.New(opt)
	if err != nil {
		return nil, fmt.Errorf("redis url: %w", err)
	}
	return &Conn{Pipe: pipe}, nil
}

// Close closes the connection.
func (c *Conn) Close() error {
	if c.Cluster != nil {
		return c.Cluster.Close()
	}
	return c.Pipe.Close()
}
