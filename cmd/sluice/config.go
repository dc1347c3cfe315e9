package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
)

// envOr returns the environment value of name, or def.
func envOr(getenv func(string) string, name, def string) string {
	if v := getenv(name); v != "" {
		return v
	}
	return def
}

// secret reads a secret from $NAME or from the file named by $NAME_FILE
// (never from a flag, so it does not show in process listings).
func secret(getenv func(string) string, name string) (string, error) {
	v, file := getenv(name), getenv(name+"_FILE")
	if v != "" && file != "" {
		return "", fmt.Errorf("set %s or %s_FILE, not both", name, name)
	}
	if file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return "", fmt.Errorf("read %s_FILE: %w", name, err)
		}
		return strings.TrimSpace(string(b)), nil
	}
	return v, nil
}

// newLogger builds the process logger: JSON (default) or text on w.
func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("log format %q: want json or text", format)
}

// logFlags registers --log-level and --log-format with env fallbacks.
func logFlags(fs *flag.FlagSet, getenv func(string) string, defFormat string) (*string, *string) {
	level := fs.String("log-level", envOr(getenv, "SLUICE_LOG_LEVEL", "info"), "log level: debug, info, warn, error (SLUICE_LOG_LEVEL)")
	format := fs.String("log-format", envOr(getenv, "SLUICE_LOG_FORMAT", defFormat), "log format: json or text (SLUICE_LOG_FORMAT)")
	return level, format
}

// parseFlags parses args, rejecting positional arguments.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return errors.New("unexpected arguments: " + strings.Join(fs.Args(), " "))
	}
	return nil
}
