package main

import (
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"
)

// config is the file at configPath: named contexts, each a server and an
// admin token, and the one in use. It holds secrets, so it is written
// with mode 0600 in a 0700 directory.
type config struct {
	CurrentContext string          `json:"current-context,omitempty"`
	Contexts       []configContext `json:"contexts"`
}

// configContext is one server and token.
type configContext struct {
	Name   string `json:"name"`
	Server string `json:"server"`
	Token  string `json:"token"`
}

// configPath returns $SLUICE_CONFIG, else $XDG_CONFIG_HOME/sluice/config.yaml,
// else ~/.config/sluice/config.yaml.
func configPath(getenv func(string) string) (string, error) {
	if p := getenv("SLUICE_CONFIG"); p != "" {
		return p, nil
	}
	if d := getenv("XDG_CONFIG_HOME"); d != "" && filepath.IsAbs(d) {
		return filepath.Join(d, "sluice", "config.yaml"), nil
	}
	home := getenv("HOME")
	if home == "" {
		h, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("find the config file: %w (set SLUICE_CONFIG)", err)
		}
		home = h
	}
	return filepath.Join(home, ".config", "sluice", "config.yaml"), nil
}

// loadConfig reads the config at path; a missing file is an empty config.
func loadConfig(path string) (*config, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return &config{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	c := &config{}
	if err := yaml.UnmarshalStrict(b, c); err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return c, nil
}

// save writes c to path atomically with mode 0600, creating the directory
// with mode 0700.
func (c *config) save(path string) error {
	b, err := yaml.Marshal(c)
	if err != nil {
		return fmt.Errorf("encode config: %w", err)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create config directory: %w", err)
	}
	f, err := os.CreateTemp(dir, ".config-*.yaml") // mode 0600
	if err != nil {
		return fmt.Errorf("write config: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after the rename
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return fmt.Errorf("write config: %w", err)
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return fmt.Errorf("write config: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("write config: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write config: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write config: %w", err)
	}
	return nil
}

// find returns the context named name, or nil.
func (c *config) find(name string) *configContext {
	for i := range c.Contexts {
		if c.Contexts[i].Name == name {
			return &c.Contexts[i]
		}
	}
	return nil
}

// upsert adds or replaces a context.
func (c *config) upsert(ctx configContext) {
	if old := c.find(ctx.Name); old != nil {
		*old = ctx
		return
	}
	c.Contexts = append(c.Contexts, ctx)
}

// remove deletes the context named name and reports whether it existed.
func (c *config) remove(name string) bool {
	for i := range c.Contexts {
		if c.Contexts[i].Name == name {
			c.Contexts = append(c.Contexts[:i], c.Contexts[i+1:]...)
			if c.CurrentContext == name {
				c.CurrentContext = ""
			}
			return true
		}
	}
	return false
}

func (c *config) names() string {
	var n []string
	for _, x := range c.Contexts {
		n = append(n, x.Name)
	}
	if len(n) == 0 {
		return "none"
	}
	return strings.Join(n, ", ")
}

// normalizeServer checks an admin API base URL and drops a trailing slash.
func normalizeServer(s string) (string, error) {
	s = strings.TrimSpace(s)
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("server %q: want an http:// or https:// URL, e.g. https://sluice.example.com", s)
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return "", fmt.Errorf("server %q: must not have a query or fragment", s)
	}
	return strings.TrimRight(s, "/"), nil
}

// validContextName checks a context name.
func validContextName(n string) error {
	if n == "" || len(n) > 100 || strings.TrimSpace(n) != n || strings.ContainsAny(n, "\n\t") {
		return fmt.Errorf("context name %q: want 1–100 characters without surrounding spaces", n)
	}
	return nil
}
