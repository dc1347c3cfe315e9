package redispipe

import (
	"fmt"
	"net/url"

	"github.com/redis/go-redis/v9"
)

// ParseURL reads redis://[[user]:password@]host[:port][/db],
// rediss://… (TLS) or unix://[[user]:password@]/path[?db=n]. Query options
// other than unix's db (go-redis pool and timeout options) are refused:
// this client has its own timeouts (the caller's context) and pool.
func ParseURL(s string) (Options, error) {
	u, err := url.Parse(s)
	if err != nil {
		return Options{}, fmt.Errorf("redis url: %w", err)
	}
	for k := range u.Query() {
		if u.Scheme == "unix" && k == "db" {
			continue
		}
		return Options{}, fmt.Errorf("redis url: option %q is not supported (the limits client takes no URL options; see --limits-call-timeout)", k)
	}
	opt, err := redis.ParseURL(s)
	if err != nil {
		return Options{}, fmt.Errorf("redis url: %w", err)
	}
	return Options{
		Network: opt.Network, Addr: opt.Addr, Username: opt.Username, Password: opt.Password,
		DB: opt.DB, TLSConfig: opt.TLSConfig,
	}, nil
}
