// CoreDNS with the plugins the local cluster's DNS needs: the kubernetes plugin's
// Service and pod records, and forwarding the rest to the host's resolver. CoreDNS's
// own main links every plugin (the clouds' SDKs with them); this one links five.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/kubernetes"
)

func init() {
	// The order the server runs them in (CoreDNS's plugin.cfg order, for these five).
	dnsserver.Directives = []string{"bind", "errors", "cache", "kubernetes", "forward"}
}

func main() { coremain.Run() }
