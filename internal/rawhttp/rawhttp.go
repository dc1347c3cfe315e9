// Package rawhttp is a lean HTTP/1.1 load client for benchmarks, in the
// manner of wrk: a request is bytes built once, and an answer is read
// without building a header map or a Response, so that the load
// generator's own cost, which shares the machine's cores with the server
// it measures, stays small and does not grow with the answer's header
// fields. net/http's client allocates two strings per header field it
// parses (a name it does not know by heart and the value) and a map of
// them all; a benchmark whose client is net/http's charges the server's
// extra header fields twice.
//
// It speaks keep-alive HTTP/1.1 on one connection at a time, answers
// with a Content-Length or chunked, and nothing else (no redirects, no
// 1xx, no HEAD, no pipelining, no TLS). It is for tests and benchmarks only.
package rawhttp

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"time"
)

// Request builds the bytes of a request: the request line, Host, the
// given header fields (name, value pairs), Content-Length and body.
func Request(method, host, path string, header [][2]string, body []byte) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: %s\r\n", method, path, host)
	for _, h := range header {
		fmt.Fprintf(&b, "%s: %s\r\n", h[0], h[1])
	}
	fmt.Fprintf(&b, "Content-Length: %d\r\n\r\n", len(body))
	b.Write(body)
	return b.Bytes()
}

// Conn is one keep-alive connection. It is not safe for concurrent use.
type Conn struct {
	addr string
	c    net.Conn
	br   *bufio.Reader
	// head holds the last answer's header lines (status line excluded),
	// body its body; both are reused by the next Do.
	head, body []byte
	// closed: the server said Connection: close; the next Do redials.
	closed bool
}

// Dial opens a connection to addr (host:port).
func Dial(addr string) (*Conn, error) {
	c := &Conn{addr: addr}
	if err := c.dial(); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Conn) dial() error {
	nc, err := net.DialTimeout("tcp", c.addr, 5*time.Second)
	if err != nil {
		return err
	}
	c.c, c.closed = nc, false
	if c.br == nil {
		c.br = bufio.NewReaderSize(nc, 16<<10)
	} else {
		c.br.Reset(nc)
	}
	return nil
}

// Close closes the connection.
func (c *Conn) Close() error {
	if c.c == nil {
		return nil
	}
	return c.c.Close()
}

// Do sends req (from Request) and reads the answer: its status and body.
// The body is valid until the next Do; Header reads the answer's fields.
// A connection the server closed is redialled first.
func (c *Conn) Do(req []byte) (status int, body []byte, err error) {
	if c.closed {
		_ = c.c.Close()
		if err := c.dial(); err != nil {
			return 0, nil, err
		}
	}
	if _, err := c.c.Write(req); err != nil {
		c.closed = true
		return 0, nil, err
	}
	status, err = c.read()
	if err != nil {
		c.closed = true
		return 0, nil, err
	}
	return status, c.body, nil
}

var (
	hContentLength    = []byte("content-length")
	hTransferEncoding = []byte("transfer-encoding")
	hConnection       = []byte("connection")
)

func (c *Conn) read() (int, error) {
	line, err := c.br.ReadSlice('\n')
	if err != nil {
		return 0, err
	}
	// "HTTP/1.1 200 OK\r\n"
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) || line[8] != ' ' {
		return 0, fmt.Errorf("rawhttp: malformed status line %q", line)
	}
	status, err := strconv.Atoi(string(line[9:12]))
	if err != nil {
		return 0, fmt.Errorf("rawhttp: malformed status line %q", line)
	}
	length, chunked := -1, false
	c.head = c.head[:0]
	for {
		line, err := c.br.ReadSlice('\n')
		if err != nil {
			return 0, err
		}
		if len(bytes.TrimRight(line, "\r\n")) == 0 {
			break
		}
		c.head = append(c.head, line...)
		name, value, ok := bytes.Cut(line, []byte{':'})
		if !ok {
			return 0, fmt.Errorf("rawhttp: malformed header line %q", line)
		}
		value = bytes.TrimSpace(value)
		switch {
		case bytes.EqualFold(name, hContentLength):
			n, err := strconv.Atoi(string(value))
			if err != nil || n < 0 {
				return 0, fmt.Errorf("rawhttp: bad Content-Length %q", value)
			}
			length = n
		case bytes.EqualFold(name, hTransferEncoding):
			chunked = bytes.EqualFold(value, []byte("chunked"))
		case bytes.EqualFold(name, hConnection):
			if bytes.EqualFold(value, []byte("close")) {
				c.closed = true
			}
		}
	}
	c.body = c.body[:0]
	switch {
	case chunked:
		return status, c.readChunked()
	case length >= 0:
		if cap(c.body) < length {
			c.body = make([]byte, length)
		}
		c.body = c.body[:length]
		_, err := io.ReadFull(c.br, c.body)
		return status, err
	case status == 204 || status == 304:
		return status, nil
	default:
		// No length: the body runs to the connection's end.
		b, err := io.ReadAll(c.br)
		c.body, c.closed = b, true
		return status, err
	}
}

func (c *Conn) readChunked() error {
	for {
		line, err := c.br.ReadSlice('\n')
		if err != nil {
			return err
		}
		sz, _, _ := bytes.Cut(bytes.TrimSpace(line), []byte{';'})
		n, err := strconv.ParseInt(string(sz), 16, 32)
		if err != nil || n < 0 {
			return fmt.Errorf("rawhttp: bad chunk size %q", line)
		}
		if n == 0 {
			// Trailer fields, then the empty line.
			for {
				line, err := c.br.ReadSlice('\n')
				if err != nil {
					return err
				}
				if len(bytes.TrimRight(line, "\r\n")) == 0 {
					return nil
				}
			}
		}
		from := len(c.body)
		c.body = slices.Grow(c.body, int(n))[:from+int(n)]
		if _, err := io.ReadFull(c.br, c.body[from:]); err != nil {
			return err
		}
		if _, err := c.br.Discard(2); err != nil { // CRLF
			return err
		}
	}
}

// Header is the value of the last answer's field name (case-insensitive),
// or nil; valid until the next Do.
func (c *Conn) Header(name string) []byte {
	for h := c.head; len(h) > 0; {
		line := h
		if i := bytes.IndexByte(h, '\n'); i >= 0 {
			line, h = h[:i+1], h[i+1:]
		} else {
			h = nil
		}
		n, v, ok := bytes.Cut(line, []byte{':'})
		if ok && bytes.EqualFold(n, []byte(name)) {
			return bytes.TrimSpace(v)
		}
	}
	return nil
}
